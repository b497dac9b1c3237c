"""The chunked head-and-loss equals the plain loss on whole logits, in value and in every gradient."""

import pytest
import torch
import torch.nn.functional as F

from attnsurg.distillation import Head, LossWeights, logit_loss, residual_stream_error


def plain_loss(hidden, weight, bias, teacher_hidden, teacher_head, input_ids, weights: LossWeights) -> torch.Tensor:
    """The textbook form: whole [batch, seq, vocab] logits, autograd for the gradients."""
    logits = F.linear(hidden, weight, bias)
    teacher_logits = F.linear(teacher_hidden, teacher_head.weight, teacher_head.bias)
    t = weights.temperature
    student = F.log_softmax(logits.flatten(0, 1) / t, dim=-1)
    teacher = F.log_softmax(teacher_logits.flatten(0, 1) / t, dim=-1)
    loss = weights.kl * t * t * F.kl_div(student, teacher, log_target=True, reduction="batchmean")
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())
    return loss + weights.lm * ce


@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("weights", [LossWeights(), LossWeights(kl=0.5, lm=1.0, temperature=2.0), LossWeights(kl=0.0, lm=1.0)],
                         ids=["kl", "kl+lm at T=2", "lm"])
def test_chunked_loss_and_gradients_equal_the_plain_ones(chunk, weights):
    torch.manual_seed(0)
    batch, seq, d, vocab = 2, 9, 16, 50
    hidden = torch.randn(batch, seq, d, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, d, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(vocab, dtype=torch.float64, requires_grad=True)
    teacher_hidden = hidden.detach() + 0.3 * torch.randn_like(hidden)
    teacher_head = Head(weight.detach() + 0.1 * torch.randn_like(weight))
    input_ids = torch.randint(vocab, (batch, seq))

    chunked = logit_loss(hidden, Head(weight, bias), teacher_hidden, teacher_head, input_ids, weights, chunk=chunk)
    grads = torch.autograd.grad(2.5 * chunked, (hidden, weight, bias))
    plain = plain_loss(hidden, weight, bias, teacher_hidden, teacher_head, input_ids, weights)
    expected = torch.autograd.grad(2.5 * plain, (hidden, weight, bias))

    torch.testing.assert_close(chunked, plain, rtol=1e-10, atol=1e-12)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_frozen_head_gets_no_gradient_and_the_teacher_none():
    hidden = torch.randn(1, 4, 8, requires_grad=True)
    head = Head(torch.randn(11, 8))
    teacher_hidden = torch.randn(1, 4, 8, requires_grad=True)
    loss = logit_loss(hidden, head, teacher_hidden, head, torch.randint(11, (1, 4)), LossWeights())
    loss.backward()
    assert hidden.grad is not None and head.weight.grad is None and teacher_hidden.grad is None


def test_loss_is_zero_when_the_student_is_the_teacher():
    hidden = torch.randn(2, 5, 8)
    head = Head(torch.randn(13, 8))
    assert logit_loss(hidden, head, hidden, head, torch.randint(13, (2, 5)), LossWeights()).abs() < 1e-6


def test_residual_stream_error_skips_the_embeddings_and_is_relative_per_token():
    teacher = (torch.ones(1, 2, 4), torch.ones(1, 2, 4), 2 * torch.ones(1, 2, 4))
    student = (torch.zeros(1, 2, 4), 1.5 * torch.ones(1, 2, 4), 2 * torch.ones(1, 2, 4))
    assert residual_stream_error(student, teacher).item() == pytest.approx((0.25 + 0.0) / 2)
    # A token with a 100x larger stream (an attention sink) counts as much as any other token, not 10^4 times more.
    sink = torch.tensor([[[100.0] * 4, [1.0] * 4]])
    off_by_half = (sink, 1.5 * sink)
    assert residual_stream_error(off_by_half, (sink, sink)).item() == pytest.approx(0.25)
    only_sink_wrong = (sink, torch.tensor([[[150.0] * 4, [1.0] * 4]]))
    assert residual_stream_error(only_sink_wrong, (sink, sink)).item() == pytest.approx(0.25 / 2)

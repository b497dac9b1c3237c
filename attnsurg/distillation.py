"""The distillation loss, computed from the final hidden states a chunk of tokens at a time.

Per token: ``kl_weight * T^2 KL(p_teacher^T || p_student^T) + lm_weight * CE(student, next token)`` (Hinton et
al. 2015, eq. 1-2, with temperature T), plus optionally ``hidden_weight`` times the mean over layers of the
relative error of the student's residual stream against the teacher's, token by token (intermediate-layer
distillation, as in TinyBERT, Jiao et al. 2020, eq. 7).

The output head and the loss run together over ``rows_per_chunk`` tokens at a time, and each chunk's
gradient with respect to the student's logits is closed form (softmax minus target, so nothing is saved
for a backward pass): only ``[chunk, vocab]`` float32 logits exist at once, never ``[batch, seq, vocab]``
(4.2 GB per float32 copy for a batch of 8 x 1024 tokens of a 128K vocabulary). The same idea as the fused linear
cross-entropy of Liger-Kernel (Hsu et al. 2024), here with the teacher's distribution as the target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOGITS_PER_CHUNK = 2**26  # float32 logits held per chunk (256 MB): 1365 tokens of a 49K vocabulary
IGNORE = -100  # label of a position with no next token


@dataclass(frozen=True)
class LossWeights:
    kl: float = 1.0
    lm: float = 0.0
    hidden: float = 0.0
    temperature: float = 1.0


@dataclass(frozen=True)
class Head:
    """An output projection ``logits = hidden @ weight.T + bias``."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    @classmethod
    def of(cls, module: torch.nn.Linear) -> Head:
        return cls(module.weight, module.bias)


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """``[batch * seq]`` labels: each position's next token, IGNORE at the end of every window."""
    labels = torch.full_like(input_ids, IGNORE)
    labels[:, :-1] = input_ids[:, 1:]
    return labels.flatten()


def rows_per_chunk(vocab: int) -> int:
    return max(1, LOGITS_PER_CHUNK // vocab)


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def chunk_logit_gradient(
    logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, weights: LossWeights, tokens: int,
    predicted: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's share of the loss and its gradient with respect to the student's logits (in the logits' dtype).
    Works in place on its own temporaries: each is a [chunk, vocab] tensor."""
    terms = []
    if weights.kl:
        terms.append((weights.kl / tokens, *kl_and_gradient(logits, teacher_logits, weights.temperature)))
    if weights.lm:
        terms.append((weights.lm / predicted, *cross_entropy_and_gradient(logits, labels)))
    loss, gradient = logits.new_zeros(()), torch.zeros_like(logits) if not terms else None
    for scale, part, part_gradient in terms:
        loss += scale * part
        gradient = part_gradient.mul_(scale) if gradient is None else gradient.add_(part_gradient, alpha=scale)
    return loss, gradient


def kl_and_gradient(logits: torch.Tensor, teacher_logits: torch.Tensor, t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over rows of T^2 KL(softmax(t/T) || softmax(z/T)) and its gradient T (softmax(z/T) - softmax(t/T))."""
    student = F.log_softmax(logits / t if t != 1 else logits, dim=-1)
    teacher = F.log_softmax(teacher_logits / t if t != 1 else teacher_logits, dim=-1)
    teacher_p = teacher.exp()
    kl = torch.dot(teacher_p.flatten(), teacher.sub_(student).flatten())
    return t * t * kl, student.exp_().sub_(teacher_p).mul_(t)


def cross_entropy_and_gradient(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over scored rows of -log softmax(z)[y] and its gradient softmax(z) - onehot(y) (zero where unscored)."""
    scored = (labels != IGNORE).unsqueeze(1).to(logits.dtype)
    targets = labels.clamp(min=0).unsqueeze(1)
    log_p = F.log_softmax(logits, dim=-1)
    loss = -(log_p.gather(1, targets) * scored).sum()
    gradient = log_p.exp_().scatter_add_(1, targets, -torch.ones_like(scored)).mul_(scored)
    return loss, gradient


class ChunkedHeadLoss(torch.autograd.Function):
    """Head and logit loss over chunks of rows; the gradients are formed in the forward pass."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher_hidden, teacher_head, labels, weights, chunk):
        tokens, predicted = hidden.shape[0], max(1, int((labels != IGNORE).sum()))
        loss = at_least_float32(hidden.new_zeros(()))
        grad_hidden = torch.empty_like(hidden)
        grad_weight = at_least_float32(torch.zeros_like(weight)) if ctx.needs_input_grad[1] else None
        grad_bias = at_least_float32(torch.zeros_like(bias)) if bias is not None and ctx.needs_input_grad[2] else None
        for start in range(0, tokens, chunk):
            rows = slice(start, start + chunk)
            h = hidden[rows]
            logits = at_least_float32(F.linear(h, weight, bias))
            teacher_logits = at_least_float32(F.linear(teacher_hidden[rows], teacher_head.weight, teacher_head.bias))
            part, gradient = chunk_logit_gradient(logits, teacher_logits, labels[rows], weights, tokens, predicted)
            loss += part
            gradient = gradient.to(weight.dtype)
            grad_hidden[rows] = gradient @ weight
            if grad_weight is not None:
                grad_weight += gradient.T @ h.to(weight.dtype)
            if grad_bias is not None:
                grad_bias += gradient.sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = lambda g, like: None if g is None else (g * grad_loss).to(like)  # noqa: E731
        return (scale(grad_hidden, grad_hidden.dtype), scale(grad_weight, ctx.weight_dtype),
                scale(grad_bias, ctx.weight_dtype), None, None, None, None, None)


def logit_loss(
    hidden: torch.Tensor, head: Head, teacher_hidden: torch.Tensor, teacher_head: Head, input_ids: torch.Tensor,
    weights: LossWeights, chunk: int | None = None,
) -> torch.Tensor:
    """The KL and next-token terms, averaged over tokens, from ``[batch, seq, d]`` final hidden states."""
    chunk = chunk or rows_per_chunk(head.weight.shape[0])
    return ChunkedHeadLoss.apply(hidden.flatten(0, 1), head.weight, head.bias, teacher_hidden.flatten(0, 1).detach(),
                                 teacher_head, next_token_labels(input_ids), weights, chunk)


def residual_stream_error(student_hidden: tuple[torch.Tensor, ...], teacher_hidden: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Mean over layers and tokens of ||student - teacher||^2 / ||teacher||^2, token by token (the embeddings,
    entry 0, are skipped). Relative per token, not over the whole stream: the first token of a window is an
    attention sink whose residual stream grows ~10^4 times the others' from the middle layers on, and a
    stream-wide ratio would spend the loss on it alone."""
    errors = [((s.float() - t.float()).pow(2).sum(-1) / t.float().pow(2).sum(-1)).mean()
              for s, t in zip(student_hidden[1:], teacher_hidden[1:])]
    return torch.stack(errors).mean()

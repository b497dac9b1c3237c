"""The two ways lm-evaluation-harness scores a causal LM, for any model that returns ``.logits``.

- Log-likelihood of a continuation given a context (``loglikelihood`` requests): the summed log-probability
  of the continuation's tokens, and whether each of them is the argmax (``is_greedy``, LAMBADA's accuracy).
  Context and continuation are split as lm-eval's ``HFLM._encode_pair`` does: trailing spaces of the context
  move to the continuation, the whole string is encoded, and the continuation is what follows the
  context's own encoding.
- Greedy generation (``generate_until``): argmax decoding with the model's KV cache, the path a served
  model takes.

Sequences are batched only with others of the same length, so no padding can reach a model (exact for any
attention, Loki's top-k included).
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Continuation:
    """The token ids of a context and of the continuation scored after it."""

    context: list[int]
    continuation: list[int]


@dataclass(frozen=True)
class Likelihood:
    logprob: float
    is_greedy: bool


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_pair(tokenizer, context: str, continuation: str) -> Continuation:
    """lm-eval's split of ``context + continuation`` into context and continuation tokens."""
    trailing = len(context) - len(context.rstrip())
    if trailing:
        context, continuation = context[:-trailing], context[-trailing:] + continuation
    whole = encode(tokenizer, context + continuation)
    context_ids = encode(tokenizer, context)
    return Continuation(context_ids, whole[len(context_ids) :])


FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"  # read by transformers' sdpa_attention_forward at each call


@contextmanager
def grouped_queries_in_sdpa(device: torch.device) -> Iterator[None]:
    """On CPU, torch's SDPA takes each KV head's query group itself (``enable_gqa``, torch >= 2.5) where
    transformers would otherwise copy every KV head across its group first, as it does whenever a mask is
    passed (every forward on a cache): the same attention, at about half the time per forward over an 8K
    cache (the demo, 2 cores)."""
    if device.type != "cpu" or torch.__version__ < "2.5":  # a TorchVersion: compared as a version
        yield
        return
    before = os.environ.get(FORCE_GQA)
    os.environ[FORCE_GQA] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[FORCE_GQA]
        else:
            os.environ[FORCE_GQA] = before


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def keeps_logits(model) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def same_length_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices grouped by equal length (longest first), at most ``batch_size`` per group."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and len(groups[-1]) < batch_size and lengths[groups[-1][0]] == lengths[i]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@torch.inference_mode()
def loglikelihoods(model, requests: list[Continuation], max_length: int, batch_size: int = 16) -> list[Likelihood]:
    """Summed log-probability of each continuation and whether greedy decoding would produce it.

    Inputs longer than ``max_length`` lose tokens from the left, as in lm-eval.
    """
    inputs = [(r.context + r.continuation)[-(max_length + 1) :][:-1] for r in requests]
    results: list[Likelihood | None] = [None] * len(requests)
    device = model_device(model)
    keep = keeps_logits(model)
    for group in same_length_batches([len(x) for x in inputs], batch_size):
        width = max(len(requests[i].continuation) for i in group)
        ids = torch.tensor([inputs[i] for i in group], device=device)
        logits = model(input_ids=ids, use_cache=False, **({"logits_to_keep": width} if keep else {})).logits
        logprobs = F.log_softmax(logits[:, -width:].float(), dim=-1)
        for row, i in enumerate(group):
            target = torch.tensor(requests[i].continuation, device=device)
            scores = logprobs[row, width - len(target) :]
            picked = scores.gather(-1, target[:, None]).squeeze(-1)
            greedy = bool((scores.argmax(-1) == target).all())
            results[i] = Likelihood(picked.double().sum().item(), greedy)
    return results  # type: ignore[return-value]


def cache_argument(model) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` during 5.x; use the name this model takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(output):
    cache = output.get("cache")
    return cache if cache is not None else output.get("past_key_values")


def cached_forward(model, input_ids: torch.Tensor, previous=None, last: int = 1):
    """One forward that keeps a KV cache: a prefill (``previous`` None) or a step on the cache the previous
    output returned; logits of the ``last`` positions only."""
    keep = {"logits_to_keep": last} if keeps_logits(model) else {}
    cache = {} if previous is None else {cache_argument(model): returned_cache(previous)}
    return model(input_ids=input_ids, use_cache=True, **cache, **keep)


@torch.inference_mode()
def greedy_generate(model, prompt: list[int], max_new_tokens: int, stop_ids: set[int] = frozenset()) -> list[int]:
    """Argmax decoding with the model's own KV cache (prefill once, then one token at a time)."""
    out = cached_forward(model, torch.tensor([prompt], device=model_device(model)))
    return greedy_from(model, out, max_new_tokens, stop_ids)


PREFILL_CHUNK = 2048  # tokens a long prompt is read in per forward: attention memory grows with chunk x context


@torch.inference_mode()
def prefill(model, prompt: list[int], chunk: int = PREFILL_CHUNK):
    """The model's output after reading ``prompt`` ``chunk`` tokens per forward: the last position's logits
    and the cache, which ``greedy_after`` continues from (on copies, so one prefill serves many questions)."""
    device = model_device(model)
    out = None
    for start in range(0, len(prompt), chunk):
        out = cached_forward(model, torch.tensor([prompt[start : start + chunk]], device=device), out)
    return out


def forked(output) -> dict:
    """A copy of an output's cache to continue from; the output's own cache is left as it was."""
    return {"past_key_values": copy.deepcopy(returned_cache(output))}


Guess = Callable[[list[int]], list[int]]  # the tokens generated so far -> the tokens expected next


@torch.inference_mode()
def greedy_after(model, read, continuation: list[int], max_new_tokens: int, stop_ids: set[int] = frozenset(),
                 finished: Callable[[list[int]], bool] | None = None, guess: Guess | None = None) -> list[int]:
    """Argmax decoding after ``continuation``, read on a copy of the cache of ``read`` (a ``prefill``): the same
    tokens as ``greedy_generate`` on the whole prompt.

    With a ``guess`` (the answer a right reply would give, say), decoding checks several tokens per forward,
    as speculative decoding does with a draft: each round reads the tokens so far and the guess on a fresh copy
    of the cache, keeps the guess as far as each token is the argmax after the ones before it, and the argmax
    where it departs. Every round keeps at least one token, every token kept is greedy decoding's; where the
    guess is empty, decoding goes on a token at a time."""
    tokens: list[int] = []
    while guess is not None and len(tokens) < max_new_tokens:
        proposal = guess(tokens)[: max_new_tokens - len(tokens)]
        if not proposal:
            break
        kept, done = checked_guess(model, read, continuation + tokens, proposal, stop_ids,
                                   None if finished is None else lambda more, so_far=tokens: finished(so_far + more))
        tokens = tokens + kept
        if done:
            return tokens[:max_new_tokens]
    if len(tokens) >= max_new_tokens:
        return tokens[:max_new_tokens]
    out = cached_forward(model, torch.tensor([continuation + tokens], device=model_device(model)), forked(read))
    so_far = tokens
    return so_far + greedy_from(model, out, max_new_tokens - len(so_far), stop_ids,
                                None if finished is None else lambda more: finished(so_far + more))


def checked_guess(model, read, prompt: list[int], guess: list[int], stop_ids: set[int],
                  finished: Callable[[list[int]], bool] | None) -> tuple[list[int], bool]:
    """The greedy tokens after ``prompt`` that one forward over ``prompt + guess`` settles (teacher forcing):
    the guess's tokens as far as each is the argmax after the ones before it, then the argmax where it first
    is not, or after the whole guess. And whether a stop id or ``finished`` ended the decoding there."""
    ids = torch.tensor([prompt + guess], device=model_device(model))
    predicted = cached_forward(model, ids, forked(read), last=len(guess) + 1).logits[0, -(len(guess) + 1) :]
    tokens: list[int] = []
    for position, token in enumerate(predicted.argmax(-1).tolist()):
        if token in stop_ids:
            return tokens, True
        tokens.append(token)
        if finished is not None and finished(tokens):
            return tokens, True
        if position == len(guess) or token != guess[position]:
            break
    return tokens, False


def greedy_from(model, out, max_new_tokens: int, stop_ids: set[int] = frozenset(),
                finished: Callable[[list[int]], bool] | None = None) -> list[int]:
    """Argmax tokens from an output's last logits on, each fed back through its cache, until ``max_new_tokens``,
    a stop id, or ``finished`` says the tokens so far hold the answer (the prefix of the longer generation)."""
    device = model_device(model)
    generated: list[int] = []
    for step in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        if token in stop_ids:
            break
        generated.append(token)
        if finished is not None and finished(generated):
            break
        if step + 1 < max_new_tokens:
            out = cached_forward(model, torch.tensor([[token]], device=device), out)
    return generated

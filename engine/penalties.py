"""What a request's logit bias, penalties and bans do to its logits before it samples (OpenAI's
fields, and vLLM's), in this order:

    allowed_token_ids   x[t] = -inf for every t not named (vLLM's; first, as vLLM masks)
    logit_bias          x[t] += bias[t]
    repetition_penalty  for t anywhere in the prompt or the answer so far: x[t] / r if x[t] > 0, else x[t] * r
    frequency_penalty   x[t] -= f * (times t is in the answer so far)
    presence_penalty    x[t] -= p if t is in the answer so far
    min_tokens          x[t] = -inf for the stop and end-of-sequence tokens while the answer is shorter
    bad_words           x[w[-1]] = -inf for each sequence w whose w[:-1] the answer ends with (vLLM's)

The answer so far is every token decoded after the prompt, those of earlier runs that a replay
carries included (`Request.decode_from`), so a request replayed on another worker, or split over a
prefill and a decode worker, penalizes what it would have uninterrupted. A drafted position's answer
includes the draft tokens before it: it is sampled only where they were accepted (engine/speculation.py).
Greedy rows take the argmax of the result; logprobs stay those of the model's own logits (vLLM's
default). Only a step with a penalized row pays for any of this (on CUDA, a host sync or two more:
`torch.unique`'s size is the data's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SeenTokens:
    """A row's request as its penalties see it: the prompt then the answer so far, where the
    answer starts in `token_ids`, and the tokens it may not sample yet (`min_tokens`)."""

    token_ids: Sequence[int]
    answer_from: int
    banned: tuple[int, ...] = ()


def apply_penalties(
    x: torch.Tensor, params: Sequence[SamplingParams], seen: Sequence[SeenTokens | None]
) -> torch.Tensor:
    """x: [B, V] float32 logits -> a new [B, V], with each `penalized` row's (whose `seen` must be
    given) through its bias and penalties. Touches only the tokens a row has seen or biased: a few
    hundred of a vocabulary of ~50K."""
    if x.dim() != 2 or not x.shape[0] == len(params) == len(seen):
        raise ValueError(f"logits {tuple(x.shape)} must be [B, V] with B == len(params) == len(seen)")
    for i, (p, s) in enumerate(zip(params, seen, strict=True)):
        if p.penalized and s is None:
            raise ValueError(f"penalized row {i} needs the tokens its request has seen (`seen`)")
    dev = x.device
    x = x.clone()
    for i, p in enumerate(params):
        if p.allowed_token_ids:
            allowed = torch.tensor(p.allowed_token_ids, device=dev)
            x[i] = torch.full_like(x[i], -torch.inf).index_copy_(0, allowed, x[i, allowed])
    if any(p.logit_bias for p in params):
        rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
        cols = [t for p in params for t, _ in p.logit_bias]
        bias = torch.tensor([b for p in params for _, b in p.logit_bias], dtype=x.dtype, device=dev)
        x.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)), bias, accumulate=True)
    rep = [
        (i, s.token_ids)
        for i, (p, s) in enumerate(zip(params, seen, strict=True))
        if s is not None and p.repetition_penalty != 1
    ]
    if rep:
        at, _ = _distinct(rep, x)
        r = torch.tensor([p.repetition_penalty for p in params], dtype=x.dtype, device=dev)[at[0]]
        v = x[at]
        x[at] = torch.where(v > 0, v / r, v * r)
    answers = [(i, s.token_ids[s.answer_from :]) for i, (p, s) in enumerate(zip(params, seen, strict=True))
               if s is not None and (p.frequency_penalty or p.presence_penalty)]  # fmt: skip
    if answers:
        at, counts = _distinct(answers, x)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype, device=dev)[at[0]]
        pres = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype, device=dev)[at[0]]
        x[at] -= freq * counts.to(x.dtype) + pres
    banned = [(i, t) for i, (p, s) in enumerate(zip(params, seen, strict=True)) if s is not None
              for t in (*s.banned, *_completing(p.bad_words, s.token_ids[s.answer_from :]))]  # fmt: skip
    if banned:
        x[
            torch.tensor([i for i, _ in banned], device=dev), torch.tensor([t for _, t in banned], device=dev)
        ] = -torch.inf
    return x


def _completing(words: Sequence[Sequence[int]], answer: Sequence[int]) -> list[int]:
    """The last token of each of `words` that the answer so far ends one token short of."""
    n = len(answer)
    return [w[-1] for w in words if len(w) - 1 <= n and list(answer[n - len(w) + 1 :]) == list(w[:-1])]


def _distinct(
    tokens: Sequence[tuple[int, Sequence[int]]], x: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(row, tokens) pairs -> the (rows, token ids) index of each row's distinct tokens in x, and
    how many times each occurs. One sort for all rows: a token t of row i is i * V + t."""
    vocab = x.shape[1]
    parts = [torch.tensor(ids, dtype=torch.int64, device=x.device) + i * vocab for i, ids in tokens]
    flat, counts = torch.unique(torch.cat(parts), return_counts=True)
    return (flat // vocab, flat % vocab), counts

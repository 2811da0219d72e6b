"""Prompt logprobs (vLLM's `prompt_logprobs`; what a completion with `echo` and `logprobs` answers):
each prompt token's logprob given the tokens before it and its rank there, with the top N at its position.

Position p's logits score prompt token p + 1, so the prompt's first token has none, and a
request's `Request.prompt_logprobs` holds positions 1 to n - 1, filled as its chunks run and
sent with its first output token (a recomputation after that, preempted, scores nothing). They
come from the raw logits, as the sampled tokens' logprobs do (no penalty or bias applied).
Every position must run: a request that asks makes no prefix-cache lookup (engine/scheduler.py),
as in vLLM. A step computes the logits of its prompt rows with the rows it samples (a 512-token
chunk of SmolLM2: 512 x 49,152 fp32, 100 MB, for that step); they are scored `SLICE_ROWS` at a
time, so log_softmax's copy stays small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.request import Request

SLICE_ROWS = 64


@dataclass(frozen=True)
class PromptRows:
    """Prompt positions [start, end) of `request` whose logits a step computes, to score tokens
    start + 1 to end."""

    request: Request
    start: int
    end: int

    @staticmethod
    def of(request: Request, start: int, num_tokens: int) -> PromptRows | None:
        """The rows of a chunk of `num_tokens` from `start` that score a prompt token, or None."""
        if request.params.prompt_logprobs is None or request.num_output_tokens:  # sent with the first token
            return None
        end = min(start + num_tokens, request.num_prompt_tokens - 1)
        return PromptRows(request, start, end) if end > start else None


def score(logits: torch.Tensor, rows: Sequence[PromptRows]) -> None:
    """Record into each request the logprobs of its prompt tokens that `rows` score: row i of
    `logits` [sum of the rows' lengths, vocab] is the next row of `rows` in order. One
    host sync a slice."""
    targets: list[int] = []
    owners: list[tuple[Request, int]] = []  # (request, the prompt position it scores)
    for r in rows:
        targets += r.request.prompt_token_ids[r.start + 1 : r.end + 1]
        owners += [(r.request, p + 1) for p in range(r.start, r.end)]
    if len(targets) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows for {len(targets)} prompt tokens")
    n_top = max((r.request.params.prompt_logprobs or 0) for r in rows) if rows else 0
    device = logits.device
    for lo in range(0, len(targets), SLICE_ROWS):
        hi = min(lo + SLICE_ROWS, len(targets))
        logp = torch.log_softmax(logits[lo:hi].float(), dim=-1)  # [S, V]
        chosen = logp.gather(1, torch.tensor(targets[lo:hi], device=device).unsqueeze(1)).squeeze(1)  # [S]
        top_lp, top_ids = logp.topk(n_top, dim=-1) if n_top else (logp[:, :0], logp[:, :0].long())
        ranks = ((logp > chosen.unsqueeze(1)).sum(dim=1) + 1).tolist()  # ties share the better place
        values, top_values, ids = chosen.tolist(), top_lp.tolist(), top_ids.tolist()
        for j in range(hi - lo):
            req, pos = owners[lo + j]
            n = req.params.prompt_logprobs or 0
            top = tuple(zip(ids[j][:n], top_values[j][:n], strict=True))
            req.record_prompt_logprob(pos, TokenLogprob(targets[lo + j], values[j], top, ranks[j]))

"""Turns a batch of logits into next tokens (and logprobs), with per-request reproducible seeds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.penalties import SeenTokens, apply_penalties
from engine.sampling_params import SamplingParams

_SEED_MIX = 1_000_003
_SEED_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class SamplerOutput:
    """One token per row; `logprobs[i]` is None where row i did not ask for logprobs."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def row_seed(seed: int, output_index: int) -> int:
    """The generator seed for output token `output_index` of a request seeded with `seed` (63 bits)."""
    return (seed * _SEED_MIX + output_index) & _SEED_MASK


def _to_device(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf the logits of tokens whose probability is below min_p x the row's likeliest's
    (vLLM's and HF's min-p). x: [S, V] float32 (temperature applied); min_p: [S] in [0, 1] (0 = off).
    The likeliest token always survives. Returns a new tensor."""
    probs = x.softmax(dim=-1)  # [S, V]
    floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [S, 1]
    return x.masked_fill(probs < floor, float("-inf"))


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask to -inf the logits outside each row's top-k, then outside its nucleus of mass top_p.

    x: [S, V] float32; top_k: [S] int64 in [1, V] (V = off); top_p: [S] float32 in (0, 1].
    Ties with the k-th logit are kept; the most likely token always survives. Returns a new tensor.
    """
    vocab = x.shape[-1]
    sorted_x, order = x.sort(dim=-1)  # ascending; sorted_x, order: [S, V]
    if top_k is not None:
        kth = sorted_x.gather(1, (vocab - top_k).unsqueeze(1))  # [S, 1]
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)  # [S, V]
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


class Sampler:
    """Picks one token per row of a logits batch.

    Greedy rows take the argmax. Sampled rows are scaled by temperature, cut by min-p, top-k
    then top-p (vLLM's order), and drawn with the exponential race argmax(probs / q), q ~ Exp(1). A row with a
    seed draws q from a generator seeded by `row_seed(seed, output_index)`, so its token
    depends only on its own logits, seed and output index; other rows use the global RNG.
    A `penalized` row's logits first go through its bias and penalties (engine/penalties.py),
    which read what its request has seen so far (`seen`, None for other rows); then the tokens
    outside `allowed` (bool [B, V], structured output: engine/grammar.py) are cut.
    Logprobs come from log_softmax of the raw logits. At most two host syncs per call
    (token ids, then logprob values if any row asked) and one in the all-greedy fast path.
    """

    def __init__(self) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_index: Sequence[int],
        seen: Sequence[SeenTokens | None] = (),
        allowed: torch.Tensor | None = None,
    ) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(output_index):
            raise ValueError(
                f"logits {tuple(logits.shape)} must be [B, V] with B == len(params) ({len(params)})"
                f" == len(output_index) ({len(output_index)})"
            )
        batch = len(params)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        penalized = any(p.penalized for p in params)
        if not sampled_rows and not lp_rows and not penalized and allowed is None:
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * batch)

        raw = logits = logits.float()  # [B, V]
        if penalized:
            logits = apply_penalties(logits, params, seen if seen else [None] * batch)
        if allowed is not None:  # structured output: a guided row samples what its grammar allows
            logits = logits.masked_fill(~allowed, float("-inf"))
        token_ids = logits.argmax(dim=-1)  # [B]
        if sampled_rows:
            rows = _to_device(sampled_rows, torch.int64, logits.device)
            sampled = self._sample(
                logits.index_select(0, rows), [params[i] for i in sampled_rows], [output_index[i] for i in sampled_rows]
            )
            token_ids = token_ids.index_copy(0, rows, sampled)
        if not lp_rows:
            return SamplerOutput(token_ids.tolist(), [None] * batch)

        n_top = max(params[i].logprobs or 0 for i in lp_rows)
        rows = _to_device(lp_rows, torch.int64, logits.device)
        logp = torch.log_softmax(raw.index_select(0, rows), dim=-1)  # [L, V]
        chosen = token_ids.index_select(0, rows)  # [L]
        chosen_lp = logp.gather(1, chosen.unsqueeze(1)).squeeze(1)  # [L]
        top_lp, top_ids = logp.topk(n_top, dim=-1)  # [L, n_top], sorted descending
        ids = torch.cat([token_ids, top_ids.flatten()]).tolist()
        values = torch.cat([chosen_lp, top_lp.flatten()]).tolist()

        out: list[TokenLogprob | None] = [None] * batch
        for j, i in enumerate(lp_rows):
            n = params[i].logprobs or 0
            base = batch + j * n_top
            top = tuple((ids[base + t], values[len(lp_rows) + j * n_top + t]) for t in range(n))
            out[i] = TokenLogprob(ids[i], values[j], top)
        return SamplerOutput(ids[:batch], out)

    def _sample(self, x: torch.Tensor, params: list[SamplingParams], output_index: list[int]) -> torch.Tensor:
        """x: [S, V] float32 logits of non-greedy rows -> [S] int64 sampled token ids, on device."""
        vocab = x.shape[-1]
        device = x.device
        temps = _to_device([p.temperature for p in params], torch.float32, device)
        x = x / temps.unsqueeze(1)
        if any(p.min_p > 0 for p in params):
            x = apply_min_p(x, _to_device([p.min_p for p in params], torch.float32, device))
        top_k = top_p = None
        if any(0 < p.top_k < vocab for p in params):
            top_k = _to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64, device)
        if any(p.top_p < 1 for p in params):
            top_p = _to_device([p.top_p for p in params], torch.float32, device)
        if top_k is not None or top_p is not None:
            x = apply_top_k_top_p(x, top_k, top_p)
        probs = x.softmax(dim=-1)  # [S, V]

        q = torch.empty_like(probs)  # [S, V]
        if any(p.seed is None for p in params):
            q.exponential_()
        for j, p in enumerate(params):
            if p.seed is not None:
                q[j].exponential_(generator=self._generator(device, row_seed(p.seed, output_index[j])))
        # A zero draw would turn a masked token's 0/0 into NaN, which argmax picks.
        q.clamp_(min=torch.finfo(torch.float32).tiny)
        return (probs / q).argmax(dim=-1)

    def _generator(self, device: torch.device, seed: int) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        return gen.manual_seed(seed)

"""A prompt past 4K tokens, real model, fp32, against HF transformers.

It takes every long-context path: prefill in chunks of 2048, each after cached context
(attention split at the context and merged), then decode rows over > 4096 tokens
(attention in segments, merged). Greedy ids must match HF's, under the same near-tie rule
as test_engine_reference.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from engine.engine import Engine
from engine.sampling_params import SamplingParams
from tests.integration.reference import CHAT, RAW

NEW_TOKENS = 16


def long_prompt(engine: Engine, min_tokens: int) -> list[int]:
    """Numbered, varied paragraphs: attention has to look far back to continue it well."""
    tok = engine.tokenizer
    assert tok is not None
    texts = CHAT + RAW
    ids: list[int] = []
    i = 0
    while len(ids) < min_tokens:
        ids += tok.encode(f"\nNote {i}: {texts[i % len(texts)]} (see note {i * 7 % (i + 1)}).")
        i += 1
    return ids + tok.encode("\nNow repeat note 3 word for word:")


def hf_greedy_gaps(hf: Any, prompt: list[int], n: int, device: str = "cpu") -> tuple[list[int], list[float]]:
    """HF's greedy continuation, and its top-2 logit gap at each step (also test_gpu_engine's)."""
    # transformers 5.2x renamed the KV cache's argument and output field `past_key_values` -> `cache`
    # (the old name warns, and goes in 5.40); this runs on both sides of that.
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    tokens: list[int] = []
    gaps: list[float] = []
    with torch.no_grad():
        out = hf(torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1)
        for _ in range(n):
            top2 = out.logits[0, -1].float().topk(2)
            tokens.append(int(top2.indices[0]))
            gaps.append(float(top2.values[0] - top2.values[1]))
            out = hf(torch.tensor([tokens[-1:]], device=device), use_cache=True, **{name: getattr(out, name)})
    return tokens, gaps


def test_greedy_past_4k_tokens_matches_hf(engine_fp32: Engine, hf_model: Any) -> None:
    prompt = long_prompt(engine_fp32, 4200)
    assert len(prompt) > max(engine_fp32.config.max_num_batched_tokens, 4096)
    ref, gaps = hf_greedy_gaps(hf_model, prompt, NEW_TOKENS)
    ours = engine_fp32.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))[0]
    engine_fp32.check_integrity()
    if ours.token_ids != ref:
        i = next(j for j, (a, b) in enumerate(zip(ours.token_ids, ref, strict=True)) if a != b)
        assert gaps[i] < 1e-4, f"greedy output differs at step {i} with a top-2 gap of {gaps[i]} (not a near-tie)"

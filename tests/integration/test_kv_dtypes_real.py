"""Coded and narrow KV caches on the real model: greedy agreement with an fp32 cache.

fp32 weights and activations; only the cache differs. The measure is how many of 64 greedy
tokens each reference prompt keeps before its first divergence from the fp32 cache, averaged.
Measured: bf16 64.0 (all 10 prompts identical), int8 38.4 (3 of 10), fp8 37.6 (3 of 10).
Thresholds leave room for machine-to-machine rounding, and are justified against the default
dtype here: int8 *weights* keep only 2.1 tokens of 64 against fp32 on the same prompts, so
each of these caches stays much closer to fp32 than the default engine does.
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from tests.integration.reference import NEW_TOKENS, reference_prompts

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
MIN_MEAN_PREFIX = {"bf16": 48.0, "int8": 24.0, "fp8": 20.0}


@pytest.mark.parametrize("kv_dtype", sorted(MIN_MEAN_PREFIX))
def test_greedy_agreement_with_an_fp32_cache(engine_fp32: Engine, fp32_greedy: list[list[int]], kv_dtype: str) -> None:
    ps = reference_prompts(engine_fp32)
    coded = Engine(
        engine_fp32.model, engine_fp32.tokenizer, EngineConfig(dtype="fp32", num_blocks=512, kv_dtype=kv_dtype)
    )
    got = [r.token_ids for r in coded.generate(ps, GREEDY)]
    coded.check_integrity()
    kept = [
        next((i for i, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), len(r))
        for g, r in zip(got, fp32_greedy, strict=True)
    ]
    print(f"{kv_dtype}: tokens kept before divergence {kept}, mean {sum(kept) / len(kept):.1f}")
    assert sum(kept) / len(kept) >= MIN_MEAN_PREFIX[kv_dtype], kept

"""The engine `tandem serve` runs by default, for the tests that hold the cluster to its promises."""

from __future__ import annotations

from typing import Any

from engine.config import EngineConfig
from engine.native import ops


def serving_engine(**kw: Any) -> EngineConfig:
    """int8 (`auto` on CPUs with AVX512-VNNI) with suffix speculation, `kw` on top. Its answers
    are exact across replays, batches and prefix-cache hits because a row's result there does not
    depend on its step or chunk (the per-row int8 matmul and prefill attention); where either
    kernel is missing, only fp32 keeps that, so fp32."""
    native = ops()
    per_row = native is not None and native.linear_i8_fast and native.prefill_attention_i8_fast
    dtype = "int8" if per_row else "fp32"
    return EngineConfig(dtype=dtype, speculative="suffix", **kw)

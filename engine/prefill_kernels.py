"""Which kernel a prefill chunk's attention runs on the CPU: EngineConfig.prefill_attention.

`auto`, with int8 or int4 weights (the output is lossy anyway): the int8 kernel where it is built
(AVX512-VNNI), else the float kernel where it is fast (AVX512-BF16, or AVX2 without AVX-512),
else torch's SDPA; with float weights, torch's SDPA, fp32 throughout. Measured on a Zen 4
(AVX512-BF16 and VNNI, 2 threads), one layer's 512-query chunk over 8K keys: int8 23.6-25.4 ms,
the bf16 kernel 35-41 ms (torch's fp32 flash kernel runs at 55-130 GFLOP/s there, the bf16 one at
250-290). What each does to greedy output is in the README ("Prefill attention in int8").
"""

from __future__ import annotations

from engine.attention import PrefillAttention
from engine.native import NativeOps

HEAD_DIMS = (32, 64, 128)  # what both C kernels take


def pick_prefill_attention(
    kind: str, native: NativeOps | None, quantized: bool, head_dim: int
) -> PrefillAttention | None:
    """The kernel for `kind` (config.PREFILL_ATTENTION); None: torch's SDPA. native: the C
    library, None off the CPU or without a compiler. Raises ValueError for a kernel asked for by
    name that this CPU, build or model cannot run."""
    if kind == "torch":
        return None
    int8 = fp = None
    if native is not None and head_dim in HEAD_DIMS:
        int8 = native.prefill_attention_i8 if native.prefill_attention_i8_fast else None
        fp = native.prefill_attention if native.prefill_attention_fast else None
    if kind == "auto":
        return (int8 or fp) if quantized else None
    chosen = int8 if kind == "int8" else fp
    if chosen is None:
        why = "no C library here" if native is None else f"head dim {head_dim}" if head_dim not in HEAD_DIMS else "CPU"
        raise ValueError(f"prefill_attention {kind!r} is not available ({why}): use auto or torch")
    return chosen


def kernel_name(attention: PrefillAttention | None, native: NativeOps | None) -> str:
    """What `pick_prefill_attention` returned, by its config name: int8, float or torch."""
    if attention is None:
        return "torch"
    return "int8" if native is not None and attention == native.prefill_attention_i8 else "float"

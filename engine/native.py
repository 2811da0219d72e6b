"""The decode step's small ops, its attention and its int8 and int4 matmuls as one C call each,
the whole layer stack of a decode step as one call, and a prefill chunk's attention in floats or
int8 (engine/csrc/: decode.c, attention.c, linear_i8.c, linear_q4.c, decode_layers.c,
prefill_attention.c, prefill_attention_i8.c), built on first use.

On the CPU a one-stream decode step was mostly dispatch: each layer ran ~40 torch ops on a
576-wide row at ~3 us apiece, and the KV of every decode row was gathered (copied) before SDPA
read it. The C functions fuse RMSNorm with its residual add, RoPE with the KV-cache write, SiLU
with its multiply, and attention reads the paged cache in place, split into segments of keys
over torch's own OpenMP threads (the library links the libgomp torch loaded, so the engine
loop's thread keeps one team: engine/torch_threads.py); int8 caches are read as codes, bf16 as floats.
A layer is four matmuls and four C calls. Measured (int8 SmolLM2, 2 cores, alternated in one
process): a decode step of 1 row 16.4 -> 9.2 ms, of 8 rows 26.7 -> 19.3 ms, of 1 row at 8K
context 57.8 -> 31.6 ms. With int8 weights the matmuls are linear_i8's: activations quantized
per row (a row's result does not depend on its batch), 2-4x fbgemm's speed at 1-9 rows; the
projections keep a second copy of their int8 weights in its layout (RowQuantWeight).

The library is compiled for this CPU on first use (engine/native_build.py). Without a compiler,
or with TANDEM_NATIVE=0, `ops()` is None and the engine runs its torch ops (logged once, with
the reason).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from collections.abc import Callable

import torch

from engine.config import ModelConfig
from engine.kv_codec import SCALE_BYTES
from engine.linear import RowQuantWeight
from engine.native_build import build, cache_dir
from engine.q4_weight import Q4Weight

log = logging.getLogger(__name__)

MAX_HEAD_DIM = 512  # rope_write's scratch row
# the caches the C side reads and writes, by their tensor's dtype: engine/csrc/common.h's KV_ kinds
KV_KIND = {torch.float32: 0, torch.int8: 1, torch.bfloat16: 2}

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "rms_norm": (_P, _P, _P, _P, _I, _I, _F, _I),
    "silu_mul": (_P, _P, _I, _I, _I),
    "rope_write": (_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _I, _I),
    "decode_attention": (_P, _I, _P, _P, _I, _P, _I, _P, _I, _I, _I, _I, _I, _F, _I, _P),
    "linear_i8": (_P, _I, _I, _P, _P, _P, _I, _I, _P),
    "linear_q4": (_P, _I, _I, _P, _P, _I, _I, _P),
    "prefill_attention": (_P, _I, _P, _P, _I, _I, _I, _I, _F, _I, _P),
    "prefill_attention_i8": (_P, _I, _P, _P, _I, _I, _I, _I, _F, _I, _P),
    "decode_layers": (_P, _I, _I, _P, _I, _P, _I, _I, _I, _I, _I, _I, _I, _F, _P, _P, _P, _P, _P, _I, _P, _I, _F, _I),
    "prefill_attention_fast": (),
    "prefill_attention_i8_fast": (),
    "prefill_attention_bf16": (),
    "linear_i8_fast": (),
    "linear_q4_fast": (),
    "decode_attention_int8_fast": (),
}
# these return an int: 0, or -1 without scratch (prefill_attention: -2 for a shape it does not
# take); the *_fast ones 1 where the vector kernel is built, else 0
_STATUS = (
    "decode_attention",
    "linear_i8",
    "linear_q4",
    "prefill_attention",
    "prefill_attention_i8",
    "decode_layers",
    "prefill_attention_bf16",
    *(n for n in _SIGNATURES if n.endswith("_fast")),
)


class NativeOps:
    """Typed calls into the built library. Every tensor is fp32 (int64 for indices), on the CPU,
    and contiguous where the C side says so; callers (engine/model.py) guarantee it."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, argtypes in _SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = ctypes.c_int if name in _STATUS else None
        self._lib = lib

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, delta: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of x's rows, scaled by w; with delta, x += delta first (in place)."""
        out = torch.empty_like(x)
        rows, n = x.shape
        self._lib.rms_norm(x.data_ptr(), delta.data_ptr() if delta is not None else None, w.data_ptr(),
                           out.data_ptr(), rows, n, eps, torch.get_num_threads())  # fmt: skip
        return out

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gu = [gate | up], [rows, 2n] -> [rows, n]."""
        rows, n = gu.shape[0], gu.shape[1] // 2
        out = gu.new_empty(rows, n)
        self._lib.silu_mul(gu.data_ptr(), out.data_ptr(), rows, n, torch.get_num_threads())
        return out

    def rope_write(
        self,
        qkv: torch.Tensor,
        heads: int,
        kv_heads: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        """RoPE on qkv's q and k heads, in place, then its k and v heads into the caches at slots: an
        fp32 cache as they are, an int8 one (engine/kv_codec.py's rows) coded as its codec would, a
        bf16 one rounded as torch rounds."""
        head_dim = cos.shape[-1]
        self._lib.rope_write(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), heads, kv_heads, head_dim,
                             positions.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), slots.data_ptr(),
                             k_cache.data_ptr(), v_cache.data_ptr(), KV_KIND[k_cache.dtype],
                             torch.get_num_threads())  # fmt: skip

    def decode_attention(
        self,
        qkv: torch.Tensor,
        heads: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        block_size: int,
    ) -> torch.Tensor:
        """Each row's attention over its own context, read from the cache (fp32, bf16, or int8
        rows) in place, its q heads read from qkv: [rows, heads * D], on torch's threads. Raises
        MemoryError without scratch."""
        coded = k_cache.dtype == torch.int8
        kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2] - (SCALE_BYTES if coded else 0)
        rows = qkv.shape[0]
        out = qkv.new_empty(rows, heads * head_dim)
        status = self._lib.decode_attention(qkv.data_ptr(), qkv.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                            KV_KIND[k_cache.dtype], tables.data_ptr(), tables.stride(0),
                                            lens.data_ptr(), rows, heads, kv_heads, head_dim, block_size,
                                            head_dim**-0.5, torch.get_num_threads(), out.data_ptr())  # fmt: skip
        if status != 0:
            raise MemoryError(f"decode attention's scratch for {rows} rows of {int(lens.max())} tokens")
        return out

    def linear_i8(self, x: torch.Tensor, w: RowQuantWeight) -> torch.Tensor:
        """x [rows, in] @ W.T with x quantized per row (engine/csrc/linear_i8.c): each row's result
        depends on that row alone. On torch's threads. Raises MemoryError without scratch."""
        rows = x.shape[0]
        out = x.new_empty(rows, w.out_features)
        status = self._lib.linear_i8(x.data_ptr(), rows, w.in_features, w.packed.data_ptr(), w.sums.data_ptr(),
                                     w.scale.data_ptr(), w.out_features, torch.get_num_threads(),
                                     out.data_ptr())  # fmt: skip
        if status != 0:
            raise MemoryError(f"int8 linear's scratch for {rows} rows of {w.in_features}")
        return out

    def linear_q4(self, x: torch.Tensor, w: Q4Weight) -> torch.Tensor:
        """x [rows, in] @ W.T for 4-bit W, x quantized per row (engine/csrc/linear_q4.c): each row's
        result depends on that row alone. On torch's threads. Raises MemoryError without scratch."""
        rows = x.shape[0]
        out = x.new_empty(rows, w.out_features)
        status = self._lib.linear_q4(x.data_ptr(), rows, w.in_features, w.packed.data_ptr(), w.dm.data_ptr(),
                                     w.out_features, torch.get_num_threads(), out.data_ptr())  # fmt: skip
        if status != 0:
            raise MemoryError(f"int4 linear's scratch for {rows} rows of {w.in_features}")
        return out

    def decode_layers(
        self,
        h: torch.Tensor,
        weights: torch.Tensor,
        q4: bool,
        kv: torch.Tensor,
        cfg: ModelConfig,
        positions: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        block_size: int,
    ) -> None:
        """h through every layer as a step of decode rows (engine/csrc/decode_layers.c), in place:
        weights the table engine/decode_stack.py builds (q4: of 4-bit weights), kv the whole cache
        [layers, 2, ...] (fp32, bf16 or int8 rows, as its dtype says). Raises MemoryError without scratch."""
        rows, layers, d = h.shape[0], weights.shape[0], cfg.head_dim
        status = self._lib.decode_layers(h.data_ptr(), rows, layers, weights.data_ptr(), q4, kv.data_ptr(),
                                         kv.stride(1) * kv.element_size(), KV_KIND[kv.dtype], cfg.hidden_size,
                                         cfg.num_heads, cfg.num_kv_heads, d, cfg.intermediate_size, cfg.rms_norm_eps,
                                         positions.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), slots.data_ptr(),
                                         tables.data_ptr(), tables.stride(0), lens.data_ptr(), block_size, d**-0.5,
                                         torch.get_num_threads())  # fmt: skip
        if status != 0:
            raise MemoryError(f"the decode layers' scratch for {rows} rows")

    @functools.cached_property
    def linear_i8_fast(self) -> bool:
        """Whether linear_i8 runs a vector kernel, AVX512-VNNI's or AVX2's (else plain integer loops)."""
        return bool(self._lib.linear_i8_fast())

    @functools.cached_property
    def linear_q4_fast(self) -> bool:
        """Whether linear_q4 runs vector tiles, AVX512-VNNI's or AVX2's (else plain loops; the same bits)."""
        return bool(self._lib.linear_q4_fast())

    @functools.cached_property
    def prefill_attention_fast(self) -> bool:
        """Whether prefill_attention runs a vector kernel (AVX512-BF16's, or AVX2's without AVX-512)."""
        return bool(self._lib.prefill_attention_fast())

    @functools.cached_property
    def prefill_attention_bf16(self) -> bool:
        """Whether prefill_attention rounds to bf16 (AVX512-BF16's kernel, the plain loops), not fp32 (AVX2's)."""
        return bool(self._lib.prefill_attention_bf16())

    @functools.cached_property
    def decode_attention_int8_fast(self) -> bool:
        """Whether decode_attention over int8 caches (head_dim a multiple of 64) runs the integer
        kernel (int16 queries and softmax weights: engine/csrc/attention_int8.h with AVX512-VNNI,
        attention_int8_avx2.h with AVX2 alone, the same numbers), else floats."""
        return bool(self._lib.decode_attention_int8_fast())

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of a chunk's queries q [n, H, D] over keys and values [L, KVH, D] (the
        cached context, then the chunk's own: query i sees keys up to L - n + i), with q, k, the
        softmax weights and v rounded to bf16 and fp32 sums, or in fp32 throughout where
        `prefill_attention_bf16` is False (engine/csrc/prefill_attention.c). All fp32 and
        contiguous. Raises ValueError for a head dim other than 32, 64 or 128, MemoryError
        without scratch."""
        return self._prefill(self._lib.prefill_attention, q, k, v)

    @functools.cached_property
    def prefill_attention_i8_fast(self) -> bool:
        """Whether prefill_attention_i8 is built (AVX512-VNNI)."""
        return bool(self._lib.prefill_attention_i8_fast())

    def prefill_attention_i8(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`prefill_attention` with int8 dot products: q, k (less the mean of its first 16 keys)
        and v rounded to int8 per row, each block of 64 keys' softmax weights times their value's
        scale to 255ths of the block's largest (engine/csrc/prefill_attention_i8.c): a row's bits
        depend only on the keys it sees. Raises as `prefill_attention` does, and RuntimeError
        where the kernel is not built (`prefill_attention_i8_fast`)."""
        return self._prefill(self._lib.prefill_attention_i8, q, k, v)

    def _prefill(self, kernel: Callable[..., int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        (n, heads, d), (length, kv_heads, _) = q.shape, k.shape
        out = q.new_empty(n, heads, d)
        status = kernel(q.data_ptr(), n, k.data_ptr(), v.data_ptr(), length, heads, kv_heads, d, d**-0.5,
                        torch.get_num_threads(), out.data_ptr())  # fmt: skip
        if status == -3:
            raise RuntimeError("the int8 prefill attention kernel needs AVX512-VNNI, which this CPU lacks")
        if status == -2:
            raise ValueError(f"prefill attention takes head dims 32, 64 or 128 and whole GQA groups, not {q.shape}")
        if status != 0:
            raise MemoryError(f"prefill attention's scratch for {n} queries over {length} keys")
        return out


@functools.cache
def ops() -> NativeOps | None:
    """The fused ops for this process, or None (logged once, with why) where they cannot be had."""
    if os.environ.get("TANDEM_NATIVE", "1") == "0":
        log.info("native decode ops off (TANDEM_NATIVE=0): the decode step runs torch ops")
        return None
    compiler = os.environ.get("CC", "cc")
    try:
        lib = ctypes.CDLL(str(build(cache_dir(), compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or e
        log.warning("native decode ops unavailable (%s: %s): the decode step runs torch ops", compiler, detail)
        return None
    return NativeOps(lib)

"""How keys and values are stored in the paged cache: as the activations, or coded smaller.

EngineConfig.kv_dtype picks one, apart from the activation dtype:

    auto   the activation dtype; bf16 where quantized (int8, int4) weights run fp32 activations
    fp32, bf16, fp16   a float cache; attention reads it cast to the activation dtype
    int8   per (token, head): 127-level codes of x / scale, scale = max|x| / 127
    fp8    per (token, head): float8 e4m3 codes of x / scale, scale = max|x| / 448

A coded cache keeps, for each token and KV head, head_dim one-byte codes followed by the
4 bytes of the fp32 scale: rows of head_dim + 4 elements of `storage` (int8 for int8, uint8
for fp8, whose codes torch cannot index_copy as float8). Keys and values are quantized on
write and dequantized where attention gathers them; KV transfer moves the rows as they are
(a quarter of fp32's bytes, plus 4 per token and head).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.config import KV_DTYPES

_FLOATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_CODED = {"int8": (torch.int8, 127.0), "fp8": (torch.uint8, 448.0)}
SCALE_BYTES = 4


@dataclass(frozen=True)
class KVCodec:
    kind: str  # fp32, bf16, fp16, int8 or fp8
    compute: torch.dtype  # what attention reads: the activation dtype

    @classmethod
    def of(cls, kv_dtype: str, compute: torch.dtype, quantized: bool = False) -> KVCodec:
        """kv_dtype for activations of `compute`; quantized: the weights are int8 or int4, where
        `auto` is bf16 over fp32 activations. Measured there (SmolLM2, Zen 1 EPYC, int4 weights):
        decode at 8K tokens 1.57x an fp32 cache's, the same elsewhere; greedy agreement with the fp32
        model as an fp32 cache's (README, "KV cache dtypes"); and half the bytes to hold and move."""
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        if kv_dtype == "auto" and quantized and compute == torch.float32:
            kv_dtype = "bf16"
        elif kv_dtype == "auto":
            kv_dtype = next(k for k, v in _FLOATS.items() if v == compute)
        return cls(kv_dtype, compute)

    @property
    def coded(self) -> bool:
        return self.kind in _CODED

    @property
    def storage(self) -> torch.dtype:
        """dtype of the cache tensor."""
        return _CODED[self.kind][0] if self.coded else _FLOATS[self.kind]

    @functools.cached_property
    def passthrough(self) -> bool:
        """The cache holds exactly what attention computes with: no op on write or read (asked twice
        a layer each step, so computed once)."""
        return self.storage == self.compute

    def width(self, head_dim: int) -> int:
        """Elements of `storage` per token and KV head."""
        return head_dim + SCALE_BYTES if self.coded else head_dim

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[..., head_dim] activations -> [..., width] cache rows."""
        if not self.coded:
            return x.to(self.storage)
        _, levels = _CODED[self.kind]
        xf = x.float()
        scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / levels
        if self.kind == "int8":
            codes = (xf / scale).round_().to(torch.int8)
        else:
            codes = (xf / scale).to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.cat([codes, scale.view(self.storage)], dim=-1)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """[..., width] cache rows -> [..., head_dim] in the compute dtype."""
        if not self.coded:
            return rows.to(self.compute)
        codes = rows[..., :-SCALE_BYTES]
        # int8 * fp32 promotes inside one kernel (15% faster than a cast, then a multiply); torch
        # will not promote float8, so its codes are cast first
        values = codes if self.kind == "int8" else codes.view(torch.float8_e4m3fn).float()
        return (values * scales(rows)).to(self.compute)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The fp32 scale of each row of a coded cache: [..., width] -> [..., 1]."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)


def valid_scales(rows: torch.Tensor) -> bool:
    """Every scale finite and >= 0 (a slot never written, as the tail of a last block, is all zeros)."""
    s = scales(rows)
    return bool(torch.isfinite(s).all()) and bool((s >= 0).all())

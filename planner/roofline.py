"""The roofline estimator: an engine profile from an accelerator's facts and the model's shape,
for hardware that is not here. A step takes the longer of its FLOPs at peak and its bytes at
full bandwidth, plus the hardware's fixed cost per step:

    prefill of n tokens after c cached:  FLOPs 2*P*n + attention 4*L*q*(n*c + n*n/2) + head 2*h*V
                                         bytes  weights + KV of (c + n) tokens
    decode step, B requests, C context:  FLOPs B*(2*P + 2*h*V) + attention 4*L*q*C
                                         bytes  weights + KV of C tokens

P: the decoder's projection parameters; L layers; q the query width (heads x head_dim); h
hidden; V vocabulary. Weights are read once a step; KV once a token of context. Projections
run at the weights' peak (int8: the int8 rate), attention at the activations' (fp32 for int8
weights on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig
from planner.hardware import Hardware
from planner.profile import DecodePoint, EngineProfile, PrefillPoint

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "fp8": 1}
KV_EXTRA = {"int8": 4, "fp8": 4}  # a coded cache's fp32 scale per token and KV head


def gpu_kv_dtype(dtype: str, kv_dtype: str = "auto") -> str:
    """The KV cache a CUDA engine holds for weights of `dtype`: `auto` is its activations' dtype
    there, as engine/kv_codec.py resolves it (fp16 under fp16 weights, else bf16: int8 and fp8
    weights compute in bf16 on a GPU)."""
    if kv_dtype != "auto":
        return kv_dtype
    return "fp16" if dtype == "fp16" else "bf16"


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    q_width: int
    kv_width: int
    projection_params: int  # per token, all layers: QKV, O, gate/up, down
    head_params: int  # lm_head: hidden x vocab
    weight_bytes: float  # read once per step
    kv_bytes_per_token: float  # all layers, K and V

    @classmethod
    def of(cls, c: ModelConfig, dtype: str, kv_dtype: str) -> ModelShape:
        per_layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
        per_layer += 3 * c.hidden_size * c.intermediate_size
        params, head = c.num_layers * per_layer, c.hidden_size * c.vocab_size
        kv_row = c.head_dim * BYTES[kv_dtype] + KV_EXTRA.get(kv_dtype, 0)
        kv = c.num_layers * 2 * c.num_kv_heads * kv_row
        return cls(c.num_layers, c.hidden_size, c.q_size, c.kv_size, params, head, (params + head) * BYTES[dtype], kv)


def attention_dtype(compute: str) -> str:
    return "fp32" if compute == "int8" else compute


def prefill_seconds(m: ModelShape, hw: Hardware, compute: str, uncached: int, cached: int) -> float:
    linear = (2 * m.projection_params * uncached + 2 * m.head_params) / hw.flops(compute)
    attention = 4 * m.layers * m.q_width * (uncached * cached + uncached * uncached / 2)
    seconds = linear + attention / hw.flops(attention_dtype(compute))
    moved = m.weight_bytes + m.kv_bytes_per_token * (cached + uncached)
    return max(seconds, moved / hw.mem_bw) + hw.step_overhead_s


def decode_seconds(m: ModelShape, hw: Hardware, compute: str, batch: int, context: int) -> float:
    linear = batch * (2 * m.projection_params + 2 * m.head_params) / hw.flops(compute)
    seconds = linear + 4 * m.layers * m.q_width * context / hw.flops(attention_dtype(compute))
    moved = m.weight_bytes + m.kv_bytes_per_token * context
    return max(seconds, moved / hw.mem_bw) + hw.step_overhead_s


def estimate(
    like: EngineProfile, config: ModelConfig, hw: Hardware, compute: str, node_class: str | None = None
) -> EngineProfile:
    """The profile `hw` would measure at `like`'s points (same model, dtype and KV dtype)."""
    m = ModelShape.of(config, like.dtype, like.kv_dtype)
    return EngineProfile(
        node_class=node_class or hw.name,
        source=f"roofline:{hw.name}",
        model=like.model,
        dtype=like.dtype,
        kv_dtype=like.kv_dtype,
        prefill=tuple(
            PrefillPoint(p.uncached, p.cached, prefill_seconds(m, hw, compute, p.uncached, p.cached))
            for p in like.prefill
        ),
        decode=tuple(
            DecodePoint(p.batch, p.context, decode_seconds(m, hw, compute, p.batch, p.context)) for p in like.decode
        ),
    )


def relative_errors(estimated: EngineProfile, measured: EngineProfile) -> list[float]:
    """|estimated - measured| / measured at each point, prefill then decode."""
    prefill = [abs(e.seconds - m.seconds) / m.seconds for e, m in zip(estimated.prefill, measured.prefill, strict=True)]
    decode = [abs(e.seconds - m.seconds) / m.seconds for e, m in zip(estimated.decode, measured.decode, strict=True)]
    return prefill + decode

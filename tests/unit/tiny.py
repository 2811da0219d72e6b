"""A tiny random Llama config for fast engine tests."""

from __future__ import annotations

import torch

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import LlamaModel
from engine.outputs import Completion
from engine.sampling_params import SamplingParams
from engine.weights import random_weights

TINY = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=512,
    tie_embeddings=False,
)


def tiny_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    w = random_weights(TINY, seed)
    w["lm_head.weight"] = w["lm_head.weight"] * 40  # wide logit gaps: greedy is stable across batch shapes
    return w


def make_engine(model: LlamaModel, **kw: object) -> Engine:
    cfg = EngineConfig(dtype="fp32", block_size=4, **kw)  # type: ignore[arg-type]
    return Engine(model, None, cfg)


def generate_checked(
    model: LlamaModel, prompts: list[list[int]], params: SamplingParams, **kw: object
) -> list[Completion]:
    """The prompts on a fresh engine over `model`, then the second again (its prefix cached
    now), the engine's integrity checked after."""
    engine = make_engine(model, num_blocks=128, **kw)
    out = engine.generate(prompts, params) + engine.generate(prompts[1:2], params)
    engine.check_integrity()
    return out


def q4_1_blocks(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The layers' projection weights encoded as a GGUF file's Q4_1 blocks (fp16 scale and minimum
    of each 32 inputs, then 16 bytes of nibbles: input j low, j + 16 high), as
    engine/weights.py's load_q4_1_blocks returns a file's: what `int4` models are built from."""
    out = {}
    for name, w in weights.items():
        if name.startswith("model.layers.") and w.dim() == 2:
            n, k = w.shape
            b = w.float().view(n, k // 32, 32)
            lo = b.amin(-1).half()
            d = ((b.amax(-1) - lo.float()) / 15).half()
            step = torch.where(d.float() > 0, d.float(), 1.0)[..., None]
            q = ((b - lo.float()[..., None]) / step).round().clamp(0, 15).to(torch.uint8)
            nibbles = q[..., :16] | (q[..., 16:] << 4)
            dm = torch.stack([d, lo], dim=-1).view(torch.uint8).view(n, k // 32, 4)
            out[name] = torch.cat([dm, nibbles], dim=-1).reshape(n, -1).contiguous()
    return out


def quantized_model(kind: str) -> LlamaModel:
    """The tiny model with int8 projections, or ("int4") its layers' weights as Q4_1 blocks."""
    w = tiny_weights()
    if kind == "int4":
        return LlamaModel(TINY, w, torch.float32, int4=q4_1_blocks(w))
    return LlamaModel(TINY, w, torch.float32, int8=True)

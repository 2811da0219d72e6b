"""A tiny random Llama config for fast engine tests."""

from __future__ import annotations

import torch

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import LlamaModel
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

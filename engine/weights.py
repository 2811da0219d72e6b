"""Load Llama-family checkpoints (GGUF or Hugging Face safetensors) into float32 tensors.

Both loaders return the same thing: a ModelConfig and a dict of float32 tensors under
Hugging Face names (`model.layers.{i}.self_attn.q_proj.weight`, ...), in HF's layout.
GGUF files store Q and K rows permuted for llama.cpp's interleaved RoPE; they are
permuted back here so one model implementation serves both formats.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import ModelConfig
from engine.gguf_file import GGUFFile, GGUFTensor
from engine.model_files import checkpoint_kind
from engine.q4_weight import q4_1_rows

Weights = dict[str, torch.Tensor]
_Q4_1 = 3  # GGML's type number

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def load_checkpoint(path: str | Path) -> tuple[ModelConfig, Weights]:
    """Load a `.gguf` file or a Hugging Face directory (config.json + *.safetensors)."""
    p = Path(path)
    return load_gguf(p) if checkpoint_kind(p) == "gguf" else load_hf_dir(p)


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    # w: [n_head * head_dim, in]; llama.cpp interleaves each head's rotary pairs.
    head_dim = w.shape[0] // n_head
    x = w.reshape(n_head, head_dim // 2, 2, *w.shape[1:])
    return x.swapaxes(1, 2).reshape(w.shape)


def _gguf_config(fields: dict[str, Any], arch: str, vocab_size: int, tied: bool) -> ModelConfig:
    def get(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    return ModelConfig(
        vocab_size=int(get("vocab_size", vocab_size)),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("rope.dimension_count", hidden // heads)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(get("context_length", 2048)),
        tie_embeddings=tied,
    )


def _gguf_name(name: str) -> tuple[str, str | None]:
    """HF name of a GGUF tensor, and the RoPE permutation it needs undone ('q', 'k' or None)."""
    if name.startswith("blk."):
        _, layer, kind, _ = name.split(".", 3)
        rope = {"attn_q": "q", "attn_k": "k"}.get(kind)
        return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[kind]}.weight", rope
    return _GGUF_TOP_NAMES[name], None


def load_gguf(path: str | Path) -> tuple[ModelConfig, Weights]:
    """Dequantize every tensor of a llama-architecture GGUF file with the `gguf` package."""
    gf = GGUFFile(path)
    arch = gf.fields["general.architecture"]
    if arch not in ("llama", "mistral"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}; Tandem runs the llama family")
    by_name = {t.name: t for t in gf.tensors}
    tied = "output.weight" not in by_name
    config = _gguf_config(gf.fields, arch, by_name["token_embd.weight"].shape[0], tied)
    heads = {"q": config.num_heads, "k": config.num_kv_heads}

    def convert(t: GGUFTensor) -> tuple[str, torch.Tensor]:
        name, rope = _gguf_name(t.name)
        arr = gf.dequantize(t)
        if rope is not None:
            arr = _unpermute_rope(arr, heads[rope])
        return name, torch.from_numpy(np.array(arr, dtype=np.float32, order="C"))

    wanted = [t for t in gf.tensors if t.name.startswith("blk.") or t.name in _GGUF_TOP_NAMES]
    # numpy releases the GIL while dequantizing, so threads use every core.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return config, dict(pool.map(convert, wanted))


def load_q4_1_blocks(path: str | Path) -> Weights:
    """The Q4_1 tensors of a GGUF file as their raw block rows (uint8 [out, in / 32 * 20]), by HF
    name, RoPE permutation undone (a permutation of rows, which blocks do not cross): `--dtype
    int4`'s weights as the file stores them. Empty for any other checkpoint."""
    p = Path(path)
    if not (p.is_file() and p.suffix == ".gguf"):
        return {}
    gf = GGUFFile(p)
    arch = gf.fields["general.architecture"]
    heads = {"q": int(gf.fields[f"{arch}.attention.head_count"])}
    heads["k"] = int(gf.fields.get(f"{arch}.attention.head_count_kv", heads["q"]))
    out = {}
    for t in gf.tensors:
        if t.qtype == _Q4_1 and t.name.startswith("blk.") and len(t.shape) == 2:
            name, rope = _gguf_name(t.name)
            raw = gf.tensor_data(t)
            out[name] = q4_1_rows(_unpermute_rope(raw, heads[rope]) if rope is not None else raw)
    return out


def _hf_config(cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("model_type") not in ("llama", "mistral"):
        raise ValueError(f"unsupported model_type {cfg.get('model_type')!r}; Tandem runs the llama family")
    heads = int(cfg["num_attention_heads"])
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position=int(cfg.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def load_hf_dir(path: str | Path) -> tuple[ModelConfig, Weights]:
    """Load config.json and every *.safetensors shard of a Hugging Face checkpoint directory."""
    from safetensors.torch import load_file

    p = Path(path)
    config = _hf_config(json.loads((p / "config.json").read_text()))
    shards = sorted(p.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors files in {p}")
    weights: Weights = {}
    for shard in shards:
        for name, t in load_file(str(shard)).items():
            weights[name] = t.float()
    if "lm_head.weight" not in weights and not config.tie_embeddings:
        raise ValueError(f"{p}: lm_head.weight missing and tie_word_embeddings is false")
    return config, weights


def save_hf_dir(path: str | Path, config: ModelConfig, weights: Weights) -> None:
    """Write a checkpoint as config.json + model.safetensors (used to build tiny test models)."""
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    hf = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    (p / "config.json").write_text(json.dumps(hf, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(p / "model.safetensors"))


def random_weights(config: ModelConfig, seed: int = 0) -> Weights:
    """Random weights of the right shapes, for tiny test configs."""
    g = torch.Generator().manual_seed(seed)
    h, f, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    w: Weights = {"model.embed_tokens.weight": rnd(config.vocab_size, h), "model.norm.weight": 1 + rnd(h)}
    if not config.tie_embeddings:
        w["lm_head.weight"] = rnd(config.vocab_size, h)
    for i in range(config.num_layers):
        pre = f"model.layers.{i}."
        w[pre + "input_layernorm.weight"] = 1 + rnd(h)
        w[pre + "post_attention_layernorm.weight"] = 1 + rnd(h)
        w[pre + "self_attn.q_proj.weight"] = rnd(q, h)
        w[pre + "self_attn.k_proj.weight"] = rnd(kv, h)
        w[pre + "self_attn.v_proj.weight"] = rnd(kv, h)
        w[pre + "self_attn.o_proj.weight"] = rnd(h, q)
        w[pre + "mlp.gate_proj.weight"] = rnd(f, h)
        w[pre + "mlp.up_proj.weight"] = rnd(f, h)
        w[pre + "mlp.down_proj.weight"] = rnd(h, f)
    return w

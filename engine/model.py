"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings) over a paged KV cache.

Plain tensors, no nn.Module: the forward is a straight line of torch ops, so the
per-token Python cost is one call per op. Q/K/V and gate/up are fused into one matmul each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.linear import Projection
from engine.paged_cache import PagedKVCache
from engine.weights import Weights

LayerCallback = Callable[[int], None]


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Projection  # hidden -> q_size + 2 * kv_size
    o: Projection  # q_size -> hidden
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Projection  # hidden -> 2 * intermediate
    down: Projection  # intermediate -> hidden


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: Weights, dtype: torch.dtype, int8: bool = False) -> None:
        """dtype: activations and KV cache. int8: quantize the projection weights per channel."""
        self.config = config
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            return weights[name].to(dtype).contiguous()

        def proj(*names: str) -> Projection:
            return Projection(torch.cat([weights[n] for n in names]), dtype, int8)

        self.embed = w("model.embed_tokens.weight")  # [vocab, hidden]
        head = weights["model.embed_tokens.weight" if config.tie_embeddings else "lm_head.weight"]
        self.lm_head = Projection(head, dtype, int8) if int8 else None
        self._lm_head_weight = self.embed if config.tie_embeddings else w("lm_head.weight")
        self.norm = w("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                LayerWeights(
                    attn_norm=w(p + "input_layernorm.weight"),
                    qkv=proj(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                    o=proj(p + "self_attn.o_proj.weight"),
                    mlp_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=proj(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=proj(p + "mlp.down_proj.weight"),
                )
            )
        # RoPE tables as HF computes them: fp32 angles, cast to the compute dtype.
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        angles = torch.outer(torch.arange(config.max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat([angles, angles], dim=-1)  # [max_position, head_dim]
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.float32:  # bit-identical to the composite below, and fewer ops
            return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)
        # As HF: normalise in fp32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(self.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        on_layer_done: LayerCallback | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; returns float32 logits [len(logits_indices), vocab].

        Writes every token's K/V into `cache` at `meta.slot_mapping`. `on_layer_done(i)` is
        called right after layer i's KV is written, so a sender can ship it while the next
        layers compute.
        """
        cfg = self.config
        t = input_ids.shape[0]
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qs, kvs = cfg.q_size, cfg.kv_size
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        slots = meta.slot_mapping
        h = F.embedding(input_ids, self.embed)  # [T, hidden]
        for i, lw in enumerate(self.layers):
            x = self._rms_norm(h, lw.attn_norm)
            qkv = lw.qkv(x)  # [T, q_size + 2 * kv_size]
            qk = qkv[:, : qs + kvs].view(t, nh + nkv, d)
            qk = self._rope(qk, cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]  # [T, H, D], [T, KVH, D]
            v = qkv[:, qs + kvs :].view(t, nkv, d)
            cache.k_flat[i].index_copy_(0, slots, k)
            cache.v_flat[i].index_copy_(0, slots, v)
            if on_layer_done is not None:
                on_layer_done(i)
            a = paged_attention(q, k, v, cache.k_flat[i], cache.v_flat[i], meta, cache.block_size)
            h = h + lw.o(a.view(t, qs))
            x = self._rms_norm(h, lw.mlp_norm)
            gu = lw.gate_up(x)  # [T, 2 * intermediate]
            g, u = gu.chunk(2, dim=-1)
            h = h + lw.down(F.silu(g) * u)
        h = self._rms_norm(h[logits_indices], self.norm)  # [S, hidden]
        if self.lm_head is not None:
            return self.lm_head(h).float()  # [S, vocab]
        return F.linear(h, self._lm_head_weight).float()  # [S, vocab]

"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings) over a paged KV cache.

Plain tensors, no nn.Module: the forward is a straight line of torch ops, so the
per-token Python cost is one call per op. Q/K/V and gate/up are fused into one matmul each.
In fp32 on the CPU a step runs engine/fused_forward.py instead: the small ops as C calls and
decode rows attending in C (engine/native.py): there, dispatch was most of the step. Its int8
matmuls quantize activations per row (engine/csrc/linear_i8.c), so a decode row's logits do not
depend on the rows beside it; where that kernel is fast (AVX512-VNNI or AVX2), the other steps' do too:
fbgemm quantizes a whole prefill with one scale (7 bits of it), and its greedy first token matched
fp32's on 12 of 40 chat prompts, against 30 of 40 per row (33 with the fused prefill).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import fused_forward
from engine.attention import AttentionMetadata, PrefillAttention, paged_attention
from engine.config import ModelConfig
from engine.decode_stack import DecodeStack
from engine.fused_forward import project
from engine.linear import Projection
from engine.native import MAX_HEAD_DIM, NativeOps, ops
from engine.paged_cache import PagedKVCache
from engine.prefill_kernels import pick_prefill_attention
from engine.q4_weight import Q4Weight
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


_SOURCES = {  # the model's own tensor names -> the checkpoint tensors they are built from
    "attn_norm": ("input_layernorm",),
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "mlp_norm": ("post_attention_layernorm",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
TensorSource = Callable[[str], torch.Tensor]
ProjectionSource = Callable[[str], Projection]


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        dtype: torch.dtype,
        int8: bool = False,
        int4: Weights | None = None,
    ) -> None:
        """dtype: activations and KV cache. int8: quantize the projection weights per channel. int4:
        Q4_1 block rows by HF name (engine/weights.py's load_q4_1_blocks): the projections they
        cover kept in 4 bits as stored (engine/q4_weight.py), the rest (and the LM head) int8."""
        top = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
        if config.tie_embeddings:
            top["lm_head"] = top["embed"]

        def hf_names(name: str) -> list[str]:
            if name in top:
                return [top[name]]
            _, i, kind = name.split(".")
            return [f"model.layers.{i}.{n}.weight" for n in _SOURCES[kind]]

        def tensor(name: str) -> torch.Tensor:
            return weights[hf_names(name)[0]].to(dtype).contiguous()

        def projection(name: str) -> Projection:
            names = hf_names(name)
            if int4 is not None and all(n in int4 for n in names):
                q4 = Q4Weight.from_blocks(torch.cat([int4[n] for n in names]))
                if q4 is not None:
                    return Projection.of_q4(q4)
            return Projection(torch.cat([weights[n] for n in names]), dtype, int8 or int4 is not None)

        self._build(config, dtype, int8 or int4 is not None, tensor, projection)

    @classmethod
    def from_state(cls, config: ModelConfig, state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> LlamaModel:
        """The model whose `state()` this is, without converting or quantizing anything again."""
        model = cls.__new__(cls)
        names = [k.rsplit(".", 1)[0] for k in state if k.endswith((".qweight", ".wt", ".q4_packed"))]
        projections = {n: Projection.from_state(state, n) for n in names}
        model._build(config, dtype, "lm_head.qweight" in state, state.__getitem__, projections.__getitem__)
        return model

    def state(self) -> dict[str, torch.Tensor]:
        """Every prepared tensor, by name: what engine.weight_cache stores."""
        out = {"embed": self.embed, "norm": self.norm}
        if self.lm_head is not None:
            out |= self.lm_head.state("lm_head")
        elif not self.config.tie_embeddings:
            out["lm_head"] = self._lm_head_weight
        for i, lw in enumerate(self.layers):
            out |= {f"layers.{i}.attn_norm": lw.attn_norm, f"layers.{i}.mlp_norm": lw.mlp_norm}
            for kind, proj in (("qkv", lw.qkv), ("o", lw.o), ("gate_up", lw.gate_up), ("down", lw.down)):
                out |= proj.state(f"layers.{i}.{kind}")
        return out

    def _build(
        self, config: ModelConfig, dtype: torch.dtype, int8: bool, tensor: TensorSource, projection: ProjectionSource
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.quantized = int8  # the projections' weights are int8 or int4: the output is lossy anyway
        self.embed = tensor("embed")  # [vocab, hidden]
        self.lm_head = projection("lm_head") if int8 else None
        self._lm_head_weight = self.embed if config.tie_embeddings or int8 else tensor("lm_head")
        self.norm = tensor("norm")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"layers.{i}."
            self.layers.append(
                LayerWeights(
                    attn_norm=tensor(p + "attn_norm"),
                    qkv=projection(p + "qkv"),
                    o=projection(p + "o"),
                    mlp_norm=tensor(p + "mlp_norm"),
                    gate_up=projection(p + "gate_up"),
                    down=projection(p + "down"),
                )
            )
        # RoPE tables as HF computes them: fp32 angles, cast to the compute dtype.
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        angles = torch.outer(torch.arange(config.max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat([angles, angles], dim=-1)  # [max_position, head_dim]
        # the decode step's fused C ops (engine/native.py): fp32 on the CPU only
        self.native = ops() if dtype == torch.float32 and d <= MAX_HEAD_DIM else None
        # int8 projections of every step through the per-row kernel, where it is fast (see above)
        self.per_row = self.native if self.native is not None and int8 and self.native.linear_i8_fast else None
        for proj in self.projections():  # fbgemm's copies that steps will run: packed now, not in a request
            if self.per_row is None or proj.rows is None:
                proj.prepare_fbgemm()  # an int8 projection's; the others have none
        # a decode step's layers as one C call, where every projection has its per-row weight
        self.decode_stack = DecodeStack.of(self) if self.native is not None else None
        # a prefill chunk's attention: engine/prefill_kernels.py (an engine's config may pick another)
        self.prefill_attention: PrefillAttention | None = pick_prefill_attention("auto", self.native, int8, d)
        self.cos = emb.cos().to(dtype)
        # sin with rotate_half's sign folded in: -sin on the first half, +sin on the second
        self.sin = torch.cat([-angles.sin(), angles.sin()], dim=-1).to(dtype)

    def projections(self) -> list[Projection]:
        layers = [p for lw in self.layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down)]
        return [*layers, *([self.lm_head] if self.lm_head is not None else [])]

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def to(self, device: torch.device | str) -> LlamaModel:
        """Move every weight and table to `device` (in place; returns self). Raises ValueError
        for an int8 model off the CPU."""
        device = torch.device(device)
        for p in self.projections():
            p.to(device)
        self.layers = [
            LayerWeights(lw.attn_norm.to(device), lw.qkv, lw.o, lw.mlp_norm.to(device), lw.gate_up, lw.down)
            for lw in self.layers
        ]
        if device.type != "cpu":
            self.native = self.per_row = self.prefill_attention = self.decode_stack = None
        tied = self._lm_head_weight is self.embed
        self.embed, self.norm = self.embed.to(device), self.norm.to(device)
        self._lm_head_weight = self.embed if tied else self._lm_head_weight.to(device)
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.float32:  # bit-identical to the composite below, and fewer ops
            return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)
        # As HF: normalise in fp32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(self.dtype)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """HF's `x * cos + rotate_half(x) * sin`, bit for bit, in 4 ops instead of 7: rotate_half
        is a roll by half a head with the sign in `signed_sin`. x: [T, heads, head_dim]; cos and
        signed_sin: [T, 1, head_dim]."""
        rotated = x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin)
        return x.mul(cos).add_(rotated)

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
        if self.native is not None and fused_forward.fits(self, positions, cache, meta):
            return fused_forward.forward(
                self, self.native, input_ids, positions, cache, meta, logits_indices, on_layer_done
            )
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
            qkv = project(self.per_row, lw.qkv, x)  # [T, q_size + 2 * kv_size]
            qk = qkv[:, : qs + kvs].view(t, nh + nkv, d)
            qk = self.rope(qk, cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]  # [T, H, D], [T, KVH, D]
            v = qkv[:, qs + kvs :].view(t, nkv, d)
            k, v = cache.write(i, slots, k, v)
            if on_layer_done is not None:
                on_layer_done(i)
            a = paged_attention(
                q, k, v, cache.k_flat[i], cache.v_flat[i], meta, cache.block_size, cache.codec, self.prefill_attention
            )
            h = h + project(self.per_row, lw.o, a.view(t, qs))
            x = self._rms_norm(h, lw.mlp_norm)
            gu = project(self.per_row, lw.gate_up, x)  # [T, 2 * intermediate]
            g, u = gu.chunk(2, dim=-1)
            h = h + project(self.per_row, lw.down, F.silu(g) * u)
        return self.logits(h[logits_indices], self.per_row)

    def logits(self, h: torch.Tensor, native: NativeOps | None = None, fused: NativeOps | None = None) -> torch.Tensor:
        """The final norm and the LM head over the rows to sample: [S, hidden] -> fp32 [S, vocab].
        The norm in C where `fused` is given (a row's bits then do not depend on S; torch's differ
        in the last one)."""
        h = (
            fused.rms_norm(h, self.norm, self.config.rms_norm_eps)
            if fused is not None
            else self._rms_norm(h, self.norm)
        )
        if self.lm_head is not None:
            return project(native, self.lm_head, h).float()
        return F.linear(h, self._lm_head_weight).float()  # [S, vocab]

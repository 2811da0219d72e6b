"""The forward of an fp32 model on the CPU through engine/native.py's C ops: every step's small
ops fused (RMSNorm with the residual add, RoPE with the KV write, SiLU with its multiply), decode
rows attending in C. engine/model.py runs a step here where `fits` says the C ops take it."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention
from engine.linear import Projection
from engine.native import KV_KIND, NativeOps
from engine.paged_cache import PagedKVCache

if TYPE_CHECKING:
    from engine.model import LayerCallback, LlamaModel


def fits(model: LlamaModel, positions: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata) -> bool:
    """Whether this step is one the C ops take as it is: an fp32 model's cache in fp32, bf16 or
    int8 (engine/native.py's KV_KIND), int64 indices laid out as the runner builds them, every
    position in the RoPE table (the C side checks no bounds; anything else runs the torch ops,
    which do)."""
    if model.dtype != torch.float32 or cache.dtype not in KV_KIND:
        return False
    if positions.dtype != torch.int64 or meta.slot_mapping.dtype != torch.int64:
        return False
    tables, lens = meta.decode_block_tables, meta.decode_seq_lens
    if meta.num_decodes and not (
        tables is not None
        and lens is not None
        and meta.decode_max_len <= model.config.max_position
        and tables.dtype == lens.dtype == torch.int64
        and tables.is_contiguous()
    ):
        return False
    return not meta.prefills or int(positions.max()) < model.config.max_position


def forward(
    model: LlamaModel,
    native: NativeOps,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    logits_indices: torch.Tensor,
    on_layer_done: LayerCallback | None,
) -> torch.Tensor:
    """LlamaModel.forward with its small ops fused (engine/native.py): each layer is the four matmuls,
    three C calls and attention. Same cache writes; the same logits to fp32 rounding (RoPE bit
    for bit; norms, SiLU and attention sum in another order). Decode rows attend in C; a
    step's prefill chunks through paged_attention. A step of decode rows only takes the per-row
    int8 kernel wherever it runs, one with prefills as `model.per_row` says: where that is the
    same kernel (AVX512-VNNI or AVX2), a decode row computes the same bits in either step, so its
    tokens do not depend on what else the step carries (nor on speculation's extra rows). A step
    of decode rows only, with no layer callback, runs the layer loop from C in one call where
    the model has its stack (engine/decode_stack.py): the same calls, so the same bits."""
    cfg = model.config
    nh, nkv, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    qs, kvs = cfg.q_size, cfg.kv_size
    tables, lens, nd = meta.decode_block_tables, meta.decode_seq_lens, meta.num_decodes
    decode_only = not meta.prefills
    proj = native if decode_only else model.per_row
    t = input_ids.shape[0]
    h = F.embedding(input_ids, model.embed)  # [T, hidden], a new tensor: updated in place below
    if decode_only and on_layer_done is None and model.decode_stack is not None:  # the loop below, from C
        model.decode_stack.run(native, h, positions, cache, meta)
        return model.logits(h[logits_indices], proj, native)
    delta: torch.Tensor | None = None  # what the last layer adds to h
    for i, lw in enumerate(model.layers):
        x = native.rms_norm(h, lw.attn_norm, eps, delta)
        qkv = project(proj, lw.qkv, x)
        k_cache, v_cache = cache.k_flat[i], cache.v_flat[i]
        native.rope_write(qkv, nh, nkv, positions, model.cos, model.sin, meta.slot_mapping, k_cache, v_cache)
        if on_layer_done is not None:
            on_layer_done(i)
        decoded = None
        if nd:
            assert tables is not None and lens is not None
            decoded = native.decode_attention(qkv[:nd], nh, k_cache, v_cache, tables, lens, cache.block_size)
        if decode_only:
            assert decoded is not None
            a = decoded
        else:  # the chunks' own keys as the cache holds them (coded, decoded again), as cache.write gives
            q = qkv[:, :qs].view(t, nh, d)
            if cache.codec.passthrough:
                k, v = qkv[:, qs : qs + kvs].view(t, nkv, d), qkv[:, qs + kvs :].view(t, nkv, d)
            else:
                k, v = (cache.codec.decode(c.index_select(0, meta.slot_mapping)) for c in (k_cache, v_cache))
            chunks = replace(meta, num_decodes=0)  # the decode rows' attention is `decoded`
            a = paged_attention(
                q, k, v, k_cache, v_cache, chunks, cache.block_size, cache.codec, model.prefill_attention
            )
            a = a.reshape(t, qs)
            if decoded is not None:
                a[:nd] = decoded
        x = native.rms_norm(h, lw.mlp_norm, eps, project(proj, lw.o, a))
        delta = project(proj, lw.down, native.silu_mul(project(proj, lw.gate_up, x)))
    assert delta is not None
    return model.logits((h + delta)[logits_indices], proj, native)


def project(native: NativeOps | None, p: Projection, x: torch.Tensor) -> torch.Tensor:
    """p(x), through the 4-bit or the per-row int8 kernel of `native` where p has its weight (x
    contiguous fp32)."""
    if native is not None and p.q4 is not None:
        return native.linear_q4(x, p.q4)
    return native.linear_i8(x, p.rows) if native is not None and p.rows is not None else p(x)

"""Attention over the paged KV cache for one flat batch of tokens.

The flat batch puts decode tokens first, then prefill chunks:

    tokens: [ d0 d1 ... dD-1 | p0 p0 p0 p0 | p1 p1 | ... ]
              one per decode    one chunk per prefilling sequence

Decodes run as one padded, masked attention over their gathered blocks. Each prefill
chunk runs on its own: a chunk with no cached context attends causally to its own fresh
keys (the fast path, as in an unpaged model). A chunk that follows cached context
(chunked prefill or a prefix-cache hit) attends in two parts that never need a mask:
the cached context in full, and its own keys causally, merged by their log-sum-exps.
A dense [chunk, context + chunk] mask sends SDPA down a path that is 1.5-1.7x slower at
2-8K tokens (measured: 2K chunk after 2K context, one layer, 179 ms masked, 103 ms split).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv_codec import KVCodec
from engine.paged_decode import paged_decode_attention

# A chunk's causal attention in one call: q [n, H, D], keys and values [L, KVH, D] (cached
# context, then the chunk's own) -> [n, H, D]. NativeOps.prefill_attention is one.
PrefillAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PrefillChunk:
    start: int  # first row of the chunk in the flat batch
    end: int
    context_len: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks_needed] long, covering context + chunk


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: flat cache slot each token's KV goes to
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long (padded)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: tuple[PrefillChunk, ...]
    decode_max_len: int = 0  # the longest decode row's context, this token included
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] long: each row's context, its token included


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int, codec: KVCodec | None) -> torch.Tensor:
    """cache: [num_blocks * block_size, KVH, width] -> the given blocks, [len(blocks), block_size, KVH, D],
    decoded when the cache is coded or narrower than the activations.

    index_select, not advanced indexing: it is ~15x faster on CPU for this shape."""
    rows = cache.view(-1, block_size, *cache.shape[1:]).index_select(0, blocks)
    return rows if codec is None or codec.passthrough else codec.decode(rows)


def _flash_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The flash kernel behind F.scaled_dot_product_attention, which unlike it also returns the
    log-sum-exp of each query row (merging two partial attentions needs it): q, k, v
    [B, heads, n, D] -> out [B, heads, n, D], lse [B, heads, n]. The CPU's kernel (it has a meta
    one too); on CUDA the flash backend's, which takes half precision only: other dtypes there
    take `math_with_lse`."""
    if q.device.type != "cuda":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal)[:2]
    elif q.dtype in (torch.float16, torch.bfloat16):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal)[:2]
    else:
        o, lse = math_with_lse(q, k, v, is_causal)
    return o, lse


def math_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_flash_with_lse` in plain ops, in fp32, on any device. A causal mask is bottom-right
    aligned (query i sees keys up to i + keys - queries), as the flash kernels align it."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, heads, n, keys]
    if is_causal:
        n, keys = scores.shape[-2:]
        hidden = torch.ones(n, keys, dtype=torch.bool, device=q.device).triu(keys - n + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype), lse


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [n, heads, D] -> [1, heads, n, D]


def _after_context(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor
) -> torch.Tensor:
    """Attention of a chunk that follows cached context, without a mask.

    q: [n, H, D]; k, v: the chunk's own [n, KVH, D]; k_ctx, v_ctx: the context's [L, KVH, D].
    Returns [n, H, D], equal to causal attention over context + chunk (to fp32 rounding)."""
    n, nh, d = q.shape
    nkv = k.shape[1]
    group = nh // nkv
    # Context, no mask: the G query heads sharing a KV head become G*n query rows of it.
    q_rows = q.view(n, nkv, group, d).permute(1, 2, 0, 3).reshape(1, nkv, group * n, d)
    o_ctx, lse_ctx = _flash_with_lse(q_rows, _heads_first(k_ctx), _heads_first(v_ctx))
    o_ctx = o_ctx.reshape(nh, n, d)
    # Own keys, causal: 4-D inputs with KV heads repeated hit the flash kernel's fast path.
    k_rep, v_rep = (_heads_first(x.repeat_interleave(group, dim=1)) for x in (k, v))
    o_own, lse_own = _flash_with_lse(_heads_first(q), k_rep, v_rep, is_causal=True)
    return _merge(torch.stack([o_ctx, o_own[0]]), torch.stack([lse_ctx.reshape(nh, n), lse_own[0]])).transpose(0, 1)


def _merge(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Attentions over disjoint key sets -> the attention over their union.

    o: [parts, ..., D]; lse: [parts, ...], each part's log-sum-exp per query row."""
    w = torch.softmax(lse.float(), dim=0).unsqueeze(-1)
    return (o.float() * w).sum(0).to(o.dtype)


# One decode row over a long context: SDPA parallelises over (row, KV head), 3 items for
# SmolLM2 on 2 threads. Its keys cut into segments of one flash call make 3 * S items, merged
# after. Measured at 8K, per layer: 3.7 ms whole (masked), 2.8 ms in 8 segments; no gain at 2K.
_SEGMENTED_DECODE_FROM = 4096
_DECODE_SEGMENTS = 8


def _long_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [1, KVH, G, D]; k, v: [1, L, KVH, D], exactly the row's context. Returns [1, KVH, G, D]."""
    n_seg, (_, length, nkv, d) = _DECODE_SEGMENTS, k.shape
    seg = length // n_seg
    body = seg * n_seg
    ks, vs = (x[:, :body].view(n_seg, seg, nkv, d).transpose(1, 2) for x in (k, v))
    o, lse = _flash_with_lse(q.expand(n_seg, -1, -1, -1), ks, vs)  # [S, KVH, G, D], [S, KVH, G]
    if body < length:
        o_tail, lse_tail = _flash_with_lse(q, k[:, body:].transpose(1, 2), v[:, body:].transpose(1, 2))
        o, lse = torch.cat([o, o_tail]), torch.cat([lse, lse_tail])
    return _merge(o, lse).unsqueeze(0)


def _decode_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    block_size: int,
    codec: KVCodec | None,
) -> torch.Tensor:
    """The decode rows' attention, q: [nd, H, D] -> [nd, H, D]. Off the CPU through the block
    tables a tile at a time (engine/paged_decode.py: static shapes); on it, gathered whole and
    one SDPA call, which is faster there."""
    nd = q.shape[0]
    assert meta.decode_block_tables is not None
    if q.device.type != "cpu":
        assert meta.decode_seq_lens is not None
        return paged_decode_attention(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, block_size, codec
        )
    assert meta.decode_mask is not None
    # gathered: [nd * max_blocks, block_size, KVH, D] -> [nd, L, KVH, D]
    kg = _gather(k_cache, meta.decode_block_tables.flatten(), block_size, codec).view(nd, -1, *k.shape[1:])
    vg = _gather(v_cache, meta.decode_block_tables.flatten(), block_size, codec).view(nd, -1, *k.shape[1:])
    # The G query heads sharing a KV head become G query rows of that head (no GQA
    # expansion, ~1.5x faster): [nd, H, D] -> [nd, KVH, G, D].
    qd = q.view(nd, k.shape[1], -1, q.shape[-1])
    if nd == 1 and meta.decode_max_len >= _SEGMENTED_DECODE_FROM:
        length = meta.decode_max_len
        return _long_decode(qd, kg[:, :length], vg[:, :length]).view(nd, *q.shape[1:])
    return F.scaled_dot_product_attention(qd, kg.transpose(1, 2), vg.transpose(1, 2), attn_mask=meta.decode_mask).view(
        nd, *q.shape[1:]
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    block_size: int,
    codec: KVCodec | None = None,
    prefill: PrefillAttention | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] (already written to the cache); caches: [blocks*block_size, KVH, width],
    stored as `codec` says (None: as the activations). `prefill` (None: torch's SDPA) computes
    the prefill chunks' attention.

    Returns [T, H, D].
    """
    nd = meta.num_decodes
    out = q.new_empty(q.shape) if meta.prefills else q
    if nd:
        o = _decode_rows(q[:nd], k, k_cache, v_cache, meta, block_size, codec)
        if not meta.prefills:
            return o
        out[:nd] = o
    group = q.shape[1] // k.shape[1]
    for c in meta.prefills:
        rows = slice(c.start, c.end)
        if c.context_len:
            blocks, ctx = c.block_table[: -(-c.context_len // block_size)], slice(0, c.context_len)
            k_ctx = _gather(k_cache, blocks, block_size, codec).flatten(0, 1)[ctx]  # [context_len, KVH, D]
            v_ctx = _gather(v_cache, blocks, block_size, codec).flatten(0, 1)[ctx]
            if prefill is not None:
                out[rows] = prefill(q[rows].contiguous(), torch.cat([k_ctx, k[rows]]), torch.cat([v_ctx, v[rows]]))
            else:
                out[rows] = _after_context(q[rows], k[rows], v[rows], k_ctx, v_ctx)
            continue
        if prefill is not None:
            out[rows] = prefill(q[rows].contiguous(), k[rows].contiguous(), v[rows].contiguous())
            continue
        # 4-D inputs with KV heads repeated hit the CPU flash kernel; enable_gqa or 3-D
        # inputs fall back to the math path, 2-3x slower.
        kc = k[rows].repeat_interleave(group, dim=1)
        vc = v[rows].repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(_heads_first(q[rows]), _heads_first(kc), _heads_first(vc), is_causal=True)
        out[rows] = o[0].transpose(0, 1)
    return out

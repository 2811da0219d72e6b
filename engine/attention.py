"""Attention over the paged KV cache for one flat batch of tokens.

The flat batch puts decode tokens first, then prefill chunks:

    tokens: [ d0 d1 ... dD-1 | p0 p0 p0 p0 | p1 p1 | ... ]
              one per decode    one chunk per prefilling sequence

Decodes run as one padded, masked attention over their gathered blocks. Each prefill
chunk runs on its own: a chunk with no cached context attends causally to its own fresh
keys (the fast path, as in an unpaged model); a chunk that follows cached context
(chunked prefill or a prefix-cache hit) gathers its blocks and uses an explicit mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    block_size: int,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] (already written to the cache); caches: [blocks*block_size, KVH, D].

    Returns [T, H, D].
    """
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        assert meta.decode_block_tables is not None and meta.decode_mask is not None
        kvh, d = k_cache.shape[1], k_cache.shape[2]
        bt = meta.decode_block_tables
        # gathered: [nd, max_blocks * block_size, KVH, D] -> [nd, KVH, L, D]
        kg = k_cache.view(-1, block_size, kvh, d)[bt].view(nd, -1, kvh, d).transpose(1, 2)
        vg = v_cache.view(-1, block_size, kvh, d)[bt].view(nd, -1, kvh, d).transpose(1, 2)
        qd = q[:nd].unsqueeze(2)  # [nd, H, 1, D]
        o = F.scaled_dot_product_attention(qd, kg, vg, attn_mask=meta.decode_mask, enable_gqa=True)
        out[:nd] = o.squeeze(2)
    for c in meta.prefills:
        qc = q[c.start : c.end].transpose(0, 1)  # [H, n, D]
        if c.context_len == 0:
            kc = k[c.start : c.end].transpose(0, 1)  # [KVH, n, D]
            vc = v[c.start : c.end].transpose(0, 1)
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)
        else:
            n = c.end - c.start
            total = c.context_len + n
            kvh, d = k_cache.shape[1], k_cache.shape[2]
            kc = k_cache.view(-1, block_size, kvh, d)[c.block_table].view(-1, kvh, d)[:total].transpose(0, 1)
            vc = v_cache.view(-1, block_size, kvh, d)[c.block_table].view(-1, kvh, d)[:total].transpose(0, 1)
            q_pos = torch.arange(c.context_len, total).unsqueeze(1)  # [n, 1]
            mask = torch.arange(total).unsqueeze(0) <= q_pos  # [n, total]
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, enable_gqa=True)
        out[c.start : c.end] = o.transpose(0, 1)
    return out

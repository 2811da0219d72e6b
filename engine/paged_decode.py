"""Decode attention that reads the paged cache through the block tables, a tile at a time.

The CPU path (engine/attention.py) gathers each decode row's whole context into one dense,
padded tensor and hands it to SDPA: its shape changes every step, and its memory grows with
the longest row. This kernel never materialises a row's context. It walks the block-table
columns in tiles of `tile_blocks` blocks, reads those blocks for every row, and keeps an
online softmax (running max, sum and weighted values, as flash-decoding does):

    block_tables: [rows, max_blocks]       tile t = columns [t*C, (t+1)*C)
    per tile:     keys [rows, C*block_size, KVH, D] -> scores [rows, KVH, G, C*block_size]
                  masked past each row's length, then merged into (m, l, acc)

Every shape depends only on (rows, max_blocks), never on the rows' lengths, so a decode step
over a padded block table can be captured once per batch-size bucket and replayed (CUDA
graphs: engine/graph_buckets.py). Memory per tile: rows x C x block_size keys and values.

Plain torch ops, so the same code runs on CPU (where the tests check it against a dense
reference), on CUDA and on the meta device.
"""

from __future__ import annotations

import torch

from engine.kv_codec import KVCodec

TILE_BLOCKS = 16  # blocks a tile: 256 tokens at block_size 16


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    codec: KVCodec | None = None,
    tile_blocks: int = TILE_BLOCKS,
) -> torch.Tensor:
    """One query row per decode, attending to its first `seq_lens[i]` cached tokens.

    q: [rows, H, D]; k_cache, v_cache: [num_blocks * block_size, KVH, width], stored as `codec`
    says (None: as q); block_tables: [rows, max_blocks] long (padding: any valid block id);
    seq_lens: [rows] long, each >= 1. Returns [rows, H, D] in q's dtype."""
    rows, nh, d = q.shape
    nkv = k_cache.shape[1]
    group = nh // nkv
    max_blocks = block_tables.shape[1]
    scale = d**-0.5
    qf = q.float().view(rows, nkv, group, d) * scale
    m = torch.full((rows, nkv, group), float("-inf"), device=q.device)
    s = torch.zeros((rows, nkv, group), device=q.device)
    acc = torch.zeros((rows, nkv, group, d), device=q.device)
    keys = k_cache.view(-1, block_size, *k_cache.shape[1:])
    values = v_cache.view(-1, block_size, *v_cache.shape[1:])
    offsets = torch.arange(tile_blocks * block_size, device=q.device)
    for first in range(0, max_blocks, tile_blocks):
        ids = block_tables[:, first : first + tile_blocks]  # [rows, C]
        c = ids.shape[1]
        k = _tile(keys, ids, codec).view(rows, c * block_size, nkv, d)
        v = _tile(values, ids, codec).view(rows, c * block_size, nkv, d)
        scores = torch.einsum("rhgd,rthd->rhgt", qf, k)  # [rows, KVH, G, c * block_size]
        visible = (first * block_size + offsets[: c * block_size]).unsqueeze(0) < seq_lens.unsqueeze(1)
        scores = scores.masked_fill(~visible.view(rows, 1, 1, -1), float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1))
        # a row with nothing visible yet keeps m = -inf: exp(-inf - -inf) would be nan
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(scores - safe.unsqueeze(-1))
        correction = torch.exp(m - safe)
        s = s * correction + p.sum(-1)
        acc = acc * correction.unsqueeze(-1) + torch.einsum("rhgt,rthd->rhgd", p, v)
        m = m_new
    return (acc / s.unsqueeze(-1)).view(rows, nh, d).to(q.dtype)


def _tile(blocks: torch.Tensor, ids: torch.Tensor, codec: KVCodec | None) -> torch.Tensor:
    """blocks: [num_blocks, block_size, KVH, width]; ids: [rows, C] -> [rows, C, block_size, KVH, D]
    as floats (decoded when the cache is coded)."""
    t = blocks.index_select(0, ids.flatten())
    if codec is not None and not codec.passthrough:
        t = codec.decode(t)
    return t.float().view(*ids.shape, *t.shape[1:])

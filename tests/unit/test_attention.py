"""Paged attention against a dense masked reference: every prefill path, GQA, odd lengths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, PrefillChunk, paged_attention

H, KVH, D, BS = 6, 2, 16, 4


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Causal attention of q (the last len(q) positions) over all of k, v, with a dense mask, in `dtype`."""
    total = k.shape[0]
    mask = torch.arange(total).unsqueeze(0) <= torch.arange(context_len, total).unsqueeze(1)
    kr, vr = (x.to(dtype).repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(0, 1) for x in (k, v))
    o = F.scaled_dot_product_attention(q.to(dtype).transpose(0, 1), kr, vr, attn_mask=mask)
    return o.transpose(0, 1)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("context_len", "n"), [(0, 7), (4, 1), (5, 3), (8, 8), (13, 11), (37, 64)])
def test_prefill_chunk_after_context_equals_masked_reference(
    dtype: torch.dtype, tol: float, context_len: int, n: int
) -> None:
    g = torch.Generator().manual_seed(context_len * 100 + n)
    total = context_len + n
    q = torch.randn(n, H, D, generator=g).to(dtype)
    k, v = (torch.randn(total, KVH, D, generator=g).to(dtype) for _ in range(2))
    # The cache holds context + chunk in shuffled blocks, as a real block table does.
    num_blocks = -(-total // BS)
    table = torch.randperm(num_blocks + 3, generator=g)[:num_blocks]
    slots = (table.repeat_interleave(BS) * BS + torch.arange(BS).repeat(num_blocks))[:total]
    k_cache, v_cache = (torch.zeros((num_blocks + 3) * BS, KVH, D, dtype=dtype) for _ in range(2))
    k_cache[slots], v_cache[slots] = k, v
    meta = AttentionMetadata(slots[context_len:], 0, None, None, (PrefillChunk(0, n, context_len, table),))
    out = paged_attention(q, k[context_len:], v[context_len:], k_cache, v_cache, meta, BS)
    assert out.dtype == dtype and out.shape == (n, H, D)
    torch.testing.assert_close(out.float(), reference(q, k, v, context_len), atol=tol, rtol=tol)


def _decode_meta(lens: list[int], tables: list[torch.Tensor], slots: torch.Tensor) -> AttentionMetadata:
    max_blocks = max(len(t) for t in tables)
    padded = torch.stack([torch.cat([t, t.new_zeros(max_blocks - len(t))]) for t in tables])
    mask = (torch.arange(max_blocks * BS).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)).view(len(lens), 1, 1, -1)
    return AttentionMetadata(slots, len(lens), padded, mask, (), max(lens))


@pytest.mark.parametrize("lens", [[1], [37], [4096], [4103], [8000], [4103, 9], [5, 4103]])
def test_decode_rows_equal_masked_reference(lens: list[int]) -> None:
    """One row at 4K+ takes the segmented path (with and without a tail); batches take the masked one."""
    g = torch.Generator().manual_seed(sum(lens))
    blocks = [-(-n // BS) for n in lens]
    perm = torch.randperm(sum(blocks) + 2, generator=g)
    tables = [perm[sum(blocks[:i]) : sum(blocks[: i + 1])] for i in range(len(lens))]
    k_cache, v_cache = (torch.randn((sum(blocks) + 2) * BS, KVH, D, generator=g) for _ in range(2))
    q = torch.randn(len(lens), H, D, generator=g)
    last = torch.stack([t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens, strict=True)])
    meta = _decode_meta(lens, tables, last)
    out = paged_attention(q, k_cache[last], v_cache[last], k_cache, v_cache, meta, BS)
    for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
        slots = (t.repeat_interleave(BS) * BS + torch.arange(BS).repeat(len(t)))[:n]
        expected = reference(q[i : i + 1], k_cache[slots], v_cache[slots], n - 1)
        torch.testing.assert_close(out[i : i + 1], expected, atol=2e-6, rtol=2e-6)

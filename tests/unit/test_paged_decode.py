"""engine/paged_decode.py: decode attention through the block tables, a tile at a time, against
a dense fp64 reference, on plain and coded caches, GQA, many tiles and padded tables."""

from __future__ import annotations

import pytest
import torch

from engine.kv_codec import KVCodec
from engine.paged_decode import paged_decode_attention


def dense_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: list[list[int]], lens: list[int], bs: int
) -> torch.Tensor:
    """Each row's context gathered whole, softmax(q k^T / sqrt(d)) v, in fp64."""
    rows, nh, d = q.shape
    group = nh // k_cache.shape[1]
    out = []
    for i in range(rows):
        slots = [tables[i][t // bs] * bs + t % bs for t in range(lens[i])]
        k = k_cache[slots].double().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache[slots].double().repeat_interleave(group, dim=1)
        w = torch.softmax(torch.einsum("hd,lhd->hl", q[i].double(), k) / d**0.5, dim=-1)
        out.append(torch.einsum("hl,lhd->hd", w, v))
    return torch.stack(out)


def random_tables(gen: torch.Generator, lens: list[int], num_blocks: int, bs: int) -> list[list[int]]:
    """Disjoint, scattered blocks per row; each table padded to the longest with block 0."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    need = [-(-n // bs) for n in lens]
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    width = max(need)
    return [t + [0] * (width - len(t)) for t in tables]


@pytest.mark.parametrize(("lens", "tile_blocks"), [
    ([1], 16), ([5, 16, 17], 16), ([300, 7, 129, 64], 4), ([1000, 1], 16), ([33, 33], 1),
])  # fmt: skip
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
def test_matches_the_dense_reference(lens: list[int], tile_blocks: int, heads: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(len(lens) * 1000 + sum(lens))
    bs, d, num_blocks = 16, 64, 128
    nh, nkv = heads
    k_cache = torch.randn(num_blocks * bs, nkv, d, generator=gen)
    v_cache = torch.randn(num_blocks * bs, nkv, d, generator=gen)
    q = torch.randn(len(lens), nh, d, generator=gen)
    tables = random_tables(gen, lens, num_blocks, bs)
    got = paged_decode_attention(
        q, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens), bs, tile_blocks=tile_blocks
    )
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(
        got.double(), dense_reference(q, k_cache, v_cache, tables, lens, bs), atol=2e-5, rtol=1e-4
    )


def test_padding_columns_and_their_blocks_are_never_read() -> None:
    gen = torch.Generator().manual_seed(7)
    bs, d = 4, 8
    k_cache, v_cache = torch.randn(40 * bs, 2, d, generator=gen), torch.randn(40 * bs, 2, d, generator=gen)
    q = torch.randn(2, 2, d, generator=gen)
    tables, lens = [[3, 9, 0, 0, 0], [5, 6, 7, 8, 1]], [6, 19]
    want = paged_decode_attention(q, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens), bs, tile_blocks=2)
    k_cache[0:bs] = float("nan")  # block 0: only padding points there
    k_cache[9 * bs + 2 : 10 * bs] = 1e6  # past row 0's 6 tokens
    got = paged_decode_attention(q, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens), bs, tile_blocks=2)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_a_coded_cache_is_decoded_tile_by_tile(kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    bs, d, nkv, nh = 16, 64, 3, 9
    codec = KVCodec.of(kind, torch.float32)
    raw_k = torch.randn(32 * bs, nkv, d, generator=gen)
    raw_v = torch.randn(32 * bs, nkv, d, generator=gen)
    k_cache, v_cache = codec.encode(raw_k), codec.encode(raw_v)
    q = torch.randn(3, nh, d, generator=gen)
    lens = [40, 200, 3]
    tables = random_tables(gen, lens, 32, bs)
    got = paged_decode_attention(q, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens), bs, codec, 4)
    want = dense_reference(q, codec.decode(k_cache), codec.decode(v_cache), tables, lens, bs)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_the_plain_ops_attention_with_lse_matches_the_cpu_flash_kernel(causal: bool) -> None:
    from engine.attention import _flash_with_lse, math_with_lse

    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 3, 7, 16, generator=gen)
    k, v = torch.randn(1, 3, 7, 16, generator=gen), torch.randn(1, 3, 7, 16, generator=gen)
    o, lse = math_with_lse(q, k, v, causal)
    o_ref, lse_ref = _flash_with_lse(q, k, v, causal)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse_ref, atol=1e-5, rtol=1e-5)

"""The fused decode step over an int8 KV cache (engine/csrc/attention.c, rope_write's coding):
the codes it writes are engine/kv_codec.py's, bit for bit, and its attention over them is the
attention over their decoded values. (The model's decode through it against its torch ops:
test_native.py, with kv_dtype int8.)"""

from __future__ import annotations

import math

import pytest
import torch

from engine import native
from engine.kv_codec import KVCodec, scales
from engine.model import LlamaModel
from tests.unit.test_paged_decode import dense_reference, random_tables
from tests.unit.tiny import TINY, tiny_weights

CODEC = KVCodec.of("int8", torch.float32)


def test_rope_write_codes_the_kv_as_the_codec_does(ops: native.NativeOps) -> None:
    model = LlamaModel(TINY, tiny_weights(), torch.float32)
    nh, nkv, d = TINY.num_heads, TINY.num_kv_heads, TINY.head_dim
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(5, TINY.q_size + 2 * TINY.kv_size, generator=gen) * torch.logspace(-4, 2, 5)[:, None]
    qkv[2, TINY.q_size + TINY.kv_size :] = 0.0  # a zero value row: scale 1e-12 / 127, codes 0
    positions, slots = torch.tensor([0, 3, 9, 200, 511]), torch.tensor([4, 0, 31, 7, 12])
    v = qkv[:, TINY.q_size + TINY.kv_size :].reshape(5, nkv, d).clone()
    k_cache = torch.zeros(32, nkv, CODEC.width(d), dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    ops.rope_write(qkv, nh, nkv, positions, model.cos, model.sin, slots, k_cache, v_cache)
    k = qkv[:, TINY.q_size : TINY.q_size + TINY.kv_size].reshape(5, nkv, d)  # roped in place
    assert torch.equal(k_cache[slots], CODEC.encode(k)) and torch.equal(v_cache[slots], CODEC.encode(v))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


BS = 16


def coded_case(
    lens: list[int], shape: tuple[int, int, int], seed: int, q_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """qkv rows, int8 caches of 128 blocks (values 3x the keys' spread) and scattered tables."""
    gen = torch.Generator().manual_seed(seed)
    nh, nkv, d = shape
    k_cache = CODEC.encode(torch.randn(128 * BS, nkv, d, generator=gen))
    v_cache = CODEC.encode(torch.randn(128 * BS, nkv, d, generator=gen) * 3)
    qkv = torch.randn(len(lens), (nh + 2 * nkv) * d, generator=gen) * q_scale
    return qkv, k_cache, v_cache, random_tables(gen, lens, 128, BS)


@pytest.mark.parametrize("lens", [[1], [5, 16, 17], [300, 7, 129, 64], [1537, 512, 513]])
@pytest.mark.parametrize("shape", [(9, 3, 64), (12, 2, 128), (4, 2, 16)])
def test_attention_over_int8_codes_is_attention_over_their_values(
    ops: native.NativeOps,
    lens: list[int],
    shape: tuple[int, int, int],
) -> None:
    nh, d, bs = shape[0], shape[2], BS
    qkv, k_cache, v_cache, tables = coded_case(lens, shape, len(lens) * 7 + sum(lens))
    got = ops.decode_attention(qkv, nh, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens), bs)
    q = qkv[:, : nh * d].reshape(len(lens), nh, d)
    expected = dense_reference(q, CODEC.decode(k_cache), CODEC.decode(v_cache), tables, lens, bs)
    # the integer kernel rounds q and the softmax weights to int16 (2^-16 of each one's largest)
    tol = 3e-4 if ops.decode_attention_int8_fast and d % 64 == 0 else 6e-5
    torch.testing.assert_close(got.view(len(lens), nh, d).double(), expected, atol=tol, rtol=1e-4)


def exp_approx(x: torch.Tensor) -> torch.Tensor:
    """engine/csrc/common.h's exp, op for op in fp32 (so that a weight rounds to the kernel's int16)."""
    x = x.clamp(-87.3, 88.3)
    n = torch.floor(x * 1.44269504088896341 + 0.5)
    r = x - n * 0.693359375
    r = r - n * -2.12194440e-4
    p = torch.full_like(r, 1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + c
    return torch.ldexp(p * r * r + r + 1.0, n)


def segment_len(n: int) -> int:
    """engine/csrc/attention.c's: a row's keys in segments of at most 256, and an even count of
    equal ones (to 16 keys) from 64 keys on."""
    if n < 64:
        return 256
    segs = -(-n // 256)
    segs += segs % 2
    return (-(-n // segs) + 15) // 16 * 16


def int16_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: list[list[int]], lens: list[int], bs: int
) -> torch.Tensor:
    """What engine/csrc/attention_int8.h computes, in torch: per segment (segment_len) and head,
    the query and the softmax weights (numerator times the value's scale) rounded to int16 by their
    largest magnitude, integer sums with the codes; the segments merged by their maxima."""
    rows, nh, d = q.shape
    group = nh // k_cache.shape[1]
    out = torch.zeros(rows, nh, d, dtype=torch.float64)
    for i in range(rows):
        seg = segment_len(lens[i])
        slots = [tables[i][t // bs] * bs + t % bs for t in range(lens[i])]
        codes_k, scale_k = k_cache[slots][..., :d], scales(k_cache[slots])[..., 0]
        codes_v, scale_v = v_cache[slots][..., :d], scales(v_cache[slots])[..., 0]
        for h in range(nh):
            g, qh = h // group, q[i, h]
            qs, top = qh.abs().max() / 32767, torch.tensor(32767.0)  # top / x: a division, not 1 / x * top
            qi = torch.round(qh * (top / qh.abs().max())).double()
            s = (codes_k[:, g].double() @ qi).float() * qs * (scale_k[:, g] * torch.tensor(d**-0.5))
            parts = []
            for b in range(0, lens[i], seg):
                m = s[b : b + seg].max()
                p = exp_approx(s[b : b + seg] - m)
                w = p * scale_v[b : b + seg, g]
                wi = torch.round(w * (top / w.max())).double()
                parts.append((m, p.double().sum(), (wi @ codes_v[b : b + seg, g].double()) * float(w.max() / 32767)))
            mx = max(float(m) for m, _, _ in parts)
            weight = [math.exp(float(m) - mx) for m, _, _ in parts]
            total = sum(x * norm for x, (_, norm, _) in zip(weight, parts, strict=True))
            out[i, h] = sum(x * o for x, (_, _, o) in zip(weight, parts, strict=True)) / total
    return out


@pytest.mark.parametrize("lens", [[1], [5, 16, 17], [300, 7, 129, 64], [1537, 512, 513]])
# GQA groups of 3, 6, 1 and 5: the AVX2 kernel takes a group's heads 3 at a time, VNNI's 4
@pytest.mark.parametrize("shape", [(9, 3, 64), (12, 2, 128), (6, 6, 64), (10, 2, 64)])
def test_the_integer_kernel_rounds_only_the_query_and_the_weights(
    ops: native.NativeOps,
    lens: list[int],
    shape: tuple[int, int, int],
) -> None:
    if not ops.decode_attention_int8_fast:
        pytest.skip("neither AVX512-VNNI nor AVX2 here: int8 caches are read as floats (the test above)")
    nh, d, bs = shape[0], shape[2], BS
    qkv, k_cache, v_cache, tables = coded_case(lens, shape, len(lens) * 11 + sum(lens), q_scale=4)
    got = ops.decode_attention(qkv, nh, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens), bs)
    expected = int16_reference(qkv[:, : nh * d].reshape(len(lens), nh, d), k_cache, v_cache, tables, lens, bs)
    torch.testing.assert_close(got.view(len(lens), nh, d).double(), expected, atol=1e-5, rtol=1e-5)

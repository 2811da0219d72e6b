"""engine/csrc/prefill_attention.c: a prefill chunk's causal attention with bf16 dot products
(AVX512-BF16) against a torch emulation of its roundings and against exact attention; its fp32
AVX2 kernel (CPUs without AVX-512) against exact attention; through the paged path; and the
AVX2 and plain-loop builds where the machine runs another (so each runs on any CPU it can)."""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
from pathlib import Path

import pytest
import torch

from engine import native, native_build
from engine.attention import AttentionMetadata, PrefillAttention, PrefillChunk, paged_attention
from engine.linear import cpu_flags
from engine.model import LlamaModel
from engine.weights import random_weights
from tests.unit.conftest import HAS_CC
from tests.unit.test_attention import reference
from tests.unit.tiny import TINY

KEYS, HEADROOM = 32, 8.0  # the vector kernel's block of keys, and how far past its max a score moves it


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()  # round to nearest even, as vcvtne2ps2bf16


def emulated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: int | None = None) -> torch.Tensor:
    """The kernel's arithmetic in torch: q * scale * log2(e), k, the softmax weights and v
    rounded to bf16; scores, exp2, the sum and the division in fp32. The weights are rounded
    against a running max over blocks of `keys` keys, as the vector kernel goes (flash style:
    the max moves only when a block's passes it by more than HEADROOM), or against the row's
    max (None), as the plain loops do."""
    n, heads, d = q.shape
    length, group = k.shape[0], heads // k.shape[1]
    qb = bf16(q * (d**-0.5 * math.log2(math.e))).transpose(0, 1)  # [H, n, D]
    kb, vb = (bf16(x).repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))  # [H, L, D]
    s = qb @ kb.transpose(1, 2)
    s = s.masked_fill(torch.ones(n, length, dtype=torch.bool).triu(length - n + 1), float("-inf"))
    keys = keys or length
    m = torch.full((heads, n, 1), float("-inf"))
    total, acc = torch.zeros(heads, n, 1), torch.zeros(heads, n, d)
    for b in range(0, length, keys):
        sb = s[..., b : b + keys]
        top = sb.amax(-1, keepdim=True)
        m_new = torch.where(top > m + HEADROOM, torch.maximum(m, top), m)
        alpha, p = torch.exp2(m - m_new), torch.exp2(sb - m_new)
        total, acc = total * alpha + p.sum(-1, keepdim=True), acc * alpha + bf16(p) @ vb[:, b : b + keys]
        m = m_new
    return (acc / total).transpose(0, 1)


def check(ops: native.NativeOps, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """bf16 roundings: within 1e-4 of their emulation (only the order of the fp32 sums and
    exp2's last bits differ) and bf16's 8 bits of mantissa from exact attention (unit-normal
    inputs). fp32 throughout: float64 attention within fp32's own error, as torch's fp32 kernel
    (<= 1e-6 on unit-normal inputs; 1.5e-5, as torch's, where scores grow past 100)."""
    if ops.prefill_attention_bf16:
        keys = KEYS if ops.prefill_attention_fast else None
        torch.testing.assert_close(out, emulated(q, k, v, keys), rtol=0, atol=1e-4)
        torch.testing.assert_close(out, reference(q, k, v, k.shape[0] - q.shape[0]), rtol=0, atol=5e-2)
    else:
        exact = reference(q, k, v, k.shape[0] - q.shape[0], torch.float64).float()
        torch.testing.assert_close(out, exact, rtol=0, atol=5e-5)


def inputs(n: int, length: int, heads: int, kv_heads: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, d, generator=g), *(torch.randn(length, kv_heads, d, generator=g) for _ in range(2))


SHAPES = [  # n, L, heads, kv_heads, D: fresh chunks, chunks after context, odd sizes, every head dim
    (1, 1, 3, 1, 64),
    (7, 7, 9, 3, 64),
    (64, 64, 4, 4, 32),
    (5, 70, 9, 3, 64),
    (33, 100, 2, 1, 128),
    (130, 130, 6, 2, 64),
    (17, 531, 9, 3, 64),
]


@pytest.mark.parametrize(("n", "length", "heads", "kv_heads", "d"), SHAPES)
def test_equals_its_roundings_emulated_and_exact_attention_closely(
    ops: native.NativeOps, n: int, length: int, heads: int, kv_heads: int, d: int
) -> None:
    q, k, v = inputs(n, length, heads, kv_heads, d, seed=n * 1000 + length)
    check(ops, ops.prefill_attention(q, k, v), q, k, v)


def test_scores_that_keep_rising_move_the_max_many_times(ops: native.NativeOps) -> None:
    """Keys scaled up along the sequence: later blocks pass the running max by more than the
    headroom again and again, so the rescaling runs, not only the first block's max."""
    q, k, v = inputs(40, 300, 6, 2, 64, seed=11)
    q, k = q.abs() + 0.5, k.abs() * torch.linspace(0.05, 4.0, 300)[:, None, None]
    check(ops, ops.prefill_attention(q, k, v), q, k, v)


def on_threads(kernel: PrefillAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """The kernel's output on 1, 2 and 3 threads."""
    before = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(kernel(q, k, v))
    finally:
        torch.set_num_threads(before)
    return outs


def test_the_same_bits_on_any_number_of_threads(ops: native.NativeOps) -> None:
    outs = on_threads(ops.prefill_attention, *inputs(45, 300, 9, 3, 64, seed=7))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_a_shape_it_does_not_take_is_a_clear_error(ops: native.NativeOps) -> None:
    q, k, v = inputs(4, 4, 4, 2, 16, seed=1)
    with pytest.raises(ValueError, match="head dims 32, 64 or 128"):
        ops.prefill_attention(q, k, v)
    q, k, v = inputs(4, 4, 5, 2, 64, seed=1)  # 5 heads over 2 kv heads
    with pytest.raises(ValueError, match="whole GQA groups"):
        ops.prefill_attention(q, k, v)


def through_the_paged_path(kernel: PrefillAttention, context_len: int, n: int) -> tuple[torch.Tensor, ...]:
    """A chunk of n queries after context_len cached tokens, through paged_attention with
    `kernel`, its KV in scattered blocks: (out, q, k, v), k and v whole (context, then chunk)."""
    heads, kv_heads, d, bs = 6, 2, 64, 4
    total = context_len + n
    g = torch.Generator().manual_seed(total)
    q = torch.randn(n, heads, d, generator=g)
    k, v = (torch.randn(total, kv_heads, d, generator=g) for _ in range(2))
    num_blocks = -(-total // bs)
    table = torch.randperm(num_blocks + 3, generator=g)[:num_blocks]
    slots = (table.repeat_interleave(bs) * bs + torch.arange(bs).repeat(num_blocks))[:total]
    k_cache, v_cache = (torch.zeros((num_blocks + 3) * bs, kv_heads, d) for _ in range(2))
    k_cache[slots], v_cache[slots] = k, v
    meta = AttentionMetadata(slots[context_len:], 0, None, None, (PrefillChunk(0, n, context_len, table),))
    return paged_attention(q, k[context_len:], v[context_len:], k_cache, v_cache, meta, bs, None, kernel), q, k, v


PAGED_CASES = [(0, 40), (16, 9), (37, 64)]  # context_len, n


@pytest.mark.parametrize(("context_len", "n"), PAGED_CASES)
def test_the_paged_path_through_it_equals_the_masked_reference(ops: native.NativeOps, context_len: int, n: int) -> None:
    check(ops, *through_the_paged_path(ops.prefill_attention, context_len, n))


def test_an_int8_model_takes_a_c_kernel_where_the_cpu_runs_one_fast(ops: native.NativeOps) -> None:
    wide = dataclasses.replace(TINY, head_dim=32)
    int8 = LlamaModel(wide, random_weights(wide), torch.float32, int8=True)
    # this one, or the int8 kernel (tests/unit/test_native_prefill_i8.py) where that is built
    assert (int8.prefill_attention is not None) == (ops.prefill_attention_fast or ops.prefill_attention_i8_fast)
    assert LlamaModel(wide, random_weights(wide), torch.float32).prefill_attention is None  # fp32 weights: torch's
    assert LlamaModel(TINY, random_weights(TINY), torch.float32, int8=True).prefill_attention is None  # head dim 16


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
@pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags(), reason="this CPU has no AVX2 and FMA")
def test_without_avx512_the_avx2_kernel_computes_exact_attention_in_fp32(tmp_path: Path) -> None:
    """The engine's kernel on CPUs with AVX2 but no AVX-512, built so on any CPU that runs it."""
    path = native_build.build(tmp_path, os.environ.get("CC", "cc"), (*native_build.FLAGS, "-mno-avx512f"))
    avx2 = native.NativeOps(ctypes.CDLL(str(path)))
    assert avx2.prefill_attention_fast and not avx2.prefill_attention_bf16
    # past the shapes above: tiles of 8 sub-tiles, 16 q heads over 2 (scratch caps the tile),
    # a chunk after long context, fewer rows than a sub-tile
    for n, length, heads, kv_heads, d in [*SHAPES, (300, 300, 9, 3, 64), (70, 600, 16, 2, 128), (3, 400, 9, 3, 32)]:
        q, k, v = inputs(n, length, heads, kv_heads, d, seed=5)
        check(avx2, avx2.prefill_attention(q, k, v), q, k, v)
    # a row's bits do not depend on the chunk it came in: the last 190 of 300 prompt rows after
    # 110 of context (a prefix hit, a later chunk) equal the same rows of the whole prompt
    q, k, v = inputs(300, 300, 9, 3, 64, seed=6)
    assert torch.equal(avx2.prefill_attention(q[110:].contiguous(), k, v), avx2.prefill_attention(q, k, v)[110:])
    q, k, v = inputs(45, 300, 9, 3, 64, seed=8)
    q, k = q.abs() + 0.5, k.abs() * torch.linspace(0.05, 4.0, 300)[:, None, None]  # the max moves many times
    outs = on_threads(avx2.prefill_attention, q, k, v)
    check(avx2, outs[0], q, k, v)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_without_avx512_or_avx2_the_plain_loops_compute_the_same_roundings(tmp_path: Path) -> None:
    path = native_build.build(tmp_path, os.environ.get("CC", "cc"), (*native_build.FLAGS, "-mno-avx512f", "-mno-avx2"))
    plain = native.NativeOps(ctypes.CDLL(str(path)))
    assert not plain.prefill_attention_fast and plain.prefill_attention_bf16
    for n, length, heads, kv_heads, d in SHAPES:
        q, k, v = inputs(n, length, heads, kv_heads, d, seed=3)
        torch.testing.assert_close(plain.prefill_attention(q, k, v), emulated(q, k, v), rtol=0, atol=1e-4)

"""engine/csrc/prefill_attention_i8.c: a prefill chunk's causal attention with int8 dot products
(AVX512-VNNI), against a torch emulation of its roundings and against exact attention; through
the paged path; and engine/prefill_kernels.py, which picks the kernel an engine runs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine import native
from engine.config import PREFILL_ATTENTION, EngineConfig
from engine.engine import Engine
from engine.model import LlamaModel
from engine.prefill_kernels import kernel_name, pick_prefill_attention
from engine.weights import random_weights
from router.serve_args import parse
from tests.unit.test_attention import reference
from tests.unit.test_native_prefill import (
    HEADROOM,
    PAGED_CASES,
    SHAPES,
    inputs,
    on_threads,
    through_the_paged_path,
)
from tests.unit.tiny import TINY

MEAN_KEYS = 16  # the keys the kernel's mean key is taken over
KEYS = 64  # the keys of a block: its weights rounded to 255ths of their largest
CUBIC = (9.999281e-1, 6.9326097e-1, 2.4261054e-1, 5.517132e-2)  # the kernel's 2^f on [-0.5, 0.5]


@pytest.fixture
def i8(ops: native.NativeOps) -> native.NativeOps:
    if not ops.prefill_attention_i8_fast:
        pytest.skip("this CPU has no AVX512-VNNI: the int8 kernel is not built (the engine never picks it)")
    return ops


def divide(c: float, x: torch.Tensor) -> torch.Tensor:
    """c / x in one IEEE division, as the kernel's (torch computes `c / x` as c * (1 / x): an ulp
    apart, enough to move a step that falls on a half)."""
    return torch.full_like(x, c) / x


def steps(x: torch.Tensor, dims: int | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """x rounded to int8 steps of max |x| / 127 over `dims` (nearest even, as vcvtps2dq): steps, scale."""
    top = x.abs().amax(dims, keepdim=True)
    inv = torch.where(top > 0, divide(127.0, top), torch.zeros_like(top))
    return (x * inv).round().clamp(-127, 127), top / 127.0


def fma(a: torch.Tensor, b: torch.Tensor, c: float) -> torch.Tensor:
    """a * b + c rounded once to fp32, as vfmadd: the fp32 product is exact in fp64."""
    return (a.double() * b.double() + torch.tensor(c, dtype=torch.float32).double()).float()


def cubic_exp2(x: torch.Tensor) -> torch.Tensor:
    """The kernel's 2^x: its cubic by fused multiply-adds (a weight's rounding to 255ths can turn
    on the last bit), times 2^round(x)."""
    i = x.round()
    f = x - i
    p = fma(torch.full_like(f, CUBIC[3]), f, CUBIC[2])
    return fma(fma(p, f, CUBIC[1]), f, CUBIC[0]) * torch.exp2(i)


def emulated_i8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The int8 kernel's arithmetic in torch, block by block as it goes: k less the mean of its
    first 16 keys, q and v in int8 steps per row (q's scale times scale * log2(e)); the integer
    scores scaled in fp32; in each block of KEYS keys, the weights 2^(s - block max) times their
    value's scale rounded to 255ths of the block's largest such product; the running max moved
    by more than HEADROOM only; the sum of the unrounded weights divides."""
    n, heads, d = q.shape
    length, group = k.shape[0], heads // k.shape[1]
    mul = torch.tensor(d**-0.5, dtype=torch.float32) * torch.tensor(math.log2(math.e), dtype=torch.float32)
    first = k[:MEAN_KEYS]
    total = torch.zeros_like(k[0])
    for key in first:  # summed in the kernel's order (cumsum's differs in the last bits)
        total = total + key
    kq, ks = steps(k - total / len(first), -1)  # [L, KVH, D], [L, KVH, 1]
    qq, qs = steps(q, -1)
    vq, vs = steps(v, -1)
    kq, ks, vq, vs = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in (kq, ks, vq, vs))  # [H, L, .]
    exact = (qq.transpose(0, 1).double() @ kq.transpose(1, 2).double()).float()  # [H, n, L], integers
    s = exact * (ks.transpose(1, 2) * (qs * mul).transpose(0, 1))
    visible = ~torch.ones(n, length, dtype=torch.bool).triu(length - n + 1)
    s = s.masked_fill(~visible, float("-inf"))
    m = torch.full((heads, n, 1), float("-inf"))
    den, acc = torch.zeros(heads, n, 1), torch.zeros(heads, n, d)
    zero = torch.zeros(())
    for b in range(0, length, KEYS):
        sb = s[..., b : b + KEYS]
        top = sb.amax(-1, keepdim=True)
        seen = top > float("-inf")
        m_new = torch.where(seen & (top > m + HEADROOM), top, m)
        alpha = torch.where(m == m_new, torch.ones_like(m), torch.exp2(m - m_new))
        p = torch.where((sb > float("-inf")) & seen, cubic_exp2(sb - top), zero)
        w = p * vs[:, b : b + KEYS].transpose(1, 2)  # [H, n, keys]
        big = w.amax(-1, keepdim=True)
        codes = (w * torch.where(big > 0, divide(255.0, big), zero)).round()
        grow = torch.where(seen, torch.exp2(top - m_new), zero)
        den = den * alpha + p.sum(-1, keepdim=True) * grow
        acc = acc * alpha + (codes.double() @ vq[:, b : b + KEYS].double()).float() * (grow * (big * (1.0 / 255)))
        m = m_new
    return (acc / den).transpose(0, 1)


def check(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, exact_atol: float = 6e-2) -> None:
    """Within 1e-5 of its emulation (only the order of the fp32 sums and exp's last bits differ:
    every int8 step and 8-bit weight is the kernel's), and of exact attention within 6e-2 on
    unit-normal inputs: 7 bits a step against the bf16 kernel's 8, measured <= 0.031 (the bf16
    kernel: <= 0.012)."""
    torch.testing.assert_close(out, emulated_i8(q, k, v), rtol=0, atol=1e-5)
    torch.testing.assert_close(out, reference(q, k, v, k.shape[0] - q.shape[0]), rtol=0, atol=exact_atol)


@pytest.mark.parametrize(("n", "length", "heads", "kv_heads", "d"), SHAPES)
def test_equals_its_roundings_emulated_and_exact_attention_closely(
    i8: native.NativeOps, n: int, length: int, heads: int, kv_heads: int, d: int
) -> None:
    q, k, v = inputs(n, length, heads, kv_heads, d, seed=n * 1000 + length)
    check(i8.prefill_attention_i8(q, k, v), q, k, v)


def test_keys_that_share_a_large_offset_lose_nothing_to_it(i8: native.NativeOps) -> None:
    """Keys with a common offset 20x their spread: the mean key taken out first, the int8 steps
    are as fine as without it (a score's shift by q . mean changes no softmax)."""
    q, k, v = inputs(40, 300, 6, 2, 64, seed=12)
    shifted = k + 20 * torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(1))
    out = i8.prefill_attention_i8(q, shifted, v)
    check(out, q, shifted, v)
    torch.testing.assert_close(out, i8.prefill_attention_i8(q, k, v), rtol=0, atol=2e-3)


def test_scores_that_keep_rising_move_the_max_many_times(i8: native.NativeOps) -> None:
    """Scores up to 45 (std 9.6): a softmax this peaked magnifies the scores' int8 steps (about
    1% of a score: half a unit at 45). Measured from exact: 0.116 at most, 0.008 on average; the
    bf16 kernel 0.029 and 0.002. Hence the engine's kernel only where the weights are int8 or
    int4 (whose own error is far larger: README, "Prefill attention in int8")."""
    q, k, v = inputs(40, 300, 6, 2, 64, seed=11)
    q, k = q.abs() + 0.5, k.abs() * torch.linspace(0.05, 4.0, 300)[:, None, None]
    check(i8.prefill_attention_i8(q, k, v), q, k, v, exact_atol=0.15)


def test_the_same_bits_on_any_number_of_threads_and_in_any_chunk(i8: native.NativeOps) -> None:
    q, k, v = inputs(45, 300, 9, 3, 64, seed=7)
    outs = on_threads(i8.prefill_attention_i8, q, k, v)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # a row's bits do not depend on the chunk it came in (a prefix hit, a later chunk), nor on
    # the keys after it (an earlier chunk of the same prompt: 20 rows over the 255 + 20 keys)
    assert torch.equal(i8.prefill_attention_i8(q[20:].contiguous(), k, v), outs[0][20:])
    assert torch.equal(i8.prefill_attention_i8(q[:20].contiguous(), k[:275], v[:275]), outs[0][:20])


def test_a_shape_it_does_not_take_is_a_clear_error(i8: native.NativeOps) -> None:
    with pytest.raises(ValueError, match="head dims 32, 64 or 128"):
        i8.prefill_attention_i8(*inputs(4, 4, 4, 2, 16, seed=1))
    with pytest.raises(ValueError, match="whole GQA groups"):
        i8.prefill_attention_i8(*inputs(4, 4, 5, 2, 64, seed=1))


@pytest.mark.parametrize(("context_len", "n"), PAGED_CASES)
def test_the_paged_path_through_it_equals_the_masked_reference(i8: native.NativeOps, context_len: int, n: int) -> None:
    check(*through_the_paged_path(i8.prefill_attention_i8, context_len, n))


def test_auto_picks_int8_for_quantized_weights_and_torch_for_float_ones(ops: native.NativeOps) -> None:
    best = ops.prefill_attention_i8 if ops.prefill_attention_i8_fast else None
    best = best or (ops.prefill_attention if ops.prefill_attention_fast else None)
    assert pick_prefill_attention("auto", ops, True, 64) == best
    assert pick_prefill_attention("auto", ops, False, 64) is None
    assert pick_prefill_attention("torch", ops, True, 64) is None
    assert pick_prefill_attention("auto", ops, True, 16) is None  # a head dim neither kernel takes
    assert pick_prefill_attention("auto", None, True, 64) is None  # no C library
    assert kernel_name(None, ops) == "torch"
    if ops.prefill_attention_i8_fast:
        assert kernel_name(pick_prefill_attention("int8", ops, False, 64), ops) == "int8"  # by name, any weights
    if ops.prefill_attention_fast:
        assert kernel_name(pick_prefill_attention("float", ops, True, 64), ops) == "float"


def test_a_kernel_asked_for_by_name_that_cannot_run_is_a_clear_error(ops: native.NativeOps) -> None:
    with pytest.raises(ValueError, match=r"'int8' is not available \(head dim 16"):
        pick_prefill_attention("int8", ops, True, 16)
    with pytest.raises(ValueError, match=r"'float' is not available \(no C library"):
        pick_prefill_attention("float", None, True, 64)
    with pytest.raises(ValueError, match="prefill_attention must be one of auto, int8, float, torch"):
        EngineConfig(prefill_attention="fast")


def test_an_engine_runs_the_kernel_its_config_names(i8: native.NativeOps) -> None:
    wide = dataclasses.replace(TINY, head_dim=32)
    model = LlamaModel(wide, random_weights(wide), torch.float32, int8=True)
    assert kernel_name(model.prefill_attention, model.native) == "int8"
    for kind in ("torch", "int8", "auto"):
        engine = Engine(model, None, EngineConfig(dtype="int8", num_blocks=64, prefill_attention=kind))
        assert kernel_name(engine.model.prefill_attention, model.native) == ("int8" if kind == "auto" else kind)


def test_serve_takes_the_kernel_by_name() -> None:
    assert parse([]).prefill_attention == "auto"
    assert parse(["--prefill-attention", "float"]).prefill_attention == "float"
    with pytest.raises(SystemExit):
        parse(["--prefill-attention", "fast"])
    assert all(parse(["--prefill-attention", k]).prefill_attention == k for k in PREFILL_ATTENTION)

"""engine/native.py: the decode step's C ops against the torch ops they replace, the model's decode
through them against its torch path, and the build: cached, and cleanly off or missing."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import native, native_build
from engine.kv_codec import KVCodec
from engine.linear import RowQuantWeight, cpu_flags
from engine.model import LlamaModel
from engine.sampling_params import SamplingParams
from tests.unit.conftest import HAS_CC
from tests.unit.test_native_linear import per_row_reference
from tests.unit.test_paged_decode import dense_reference, random_tables
from tests.unit.tiny import TINY, generate_checked, make_engine, quantized_model, tiny_weights


@pytest.fixture
def fresh_ops() -> Iterator[None]:
    """native.ops() decided again in the test, and again after it (for the other tests)."""
    native.ops.cache_clear()
    yield
    native.ops.cache_clear()


def test_rms_norm_and_its_residual_add(ops: native.NativeOps) -> None:
    gen = torch.Generator().manual_seed(0)
    x, delta, w = torch.randn(5, 576, generator=gen), torch.randn(5, 576, generator=gen), torch.randn(576)
    expected_x = x + delta
    expected = expected_x * torch.rsqrt(expected_x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    out = ops.rms_norm(x, w, 1e-5, delta)
    assert torch.equal(x, expected_x)  # the add is done in place, exactly
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ops.rms_norm(expected_x.clone(), w, 1e-5), expected, rtol=1e-6, atol=1e-6)


def test_silu_mul_over_the_whole_range(ops: native.NativeOps) -> None:
    g = torch.cat([torch.linspace(-120, 120, 997), torch.randn(1051, generator=torch.Generator().manual_seed(1))])
    u = torch.randn(g.numel(), generator=torch.Generator().manual_seed(2))
    gu = torch.cat([g.view(2, -1), u.view(2, -1)], dim=1)  # [2, 2n]: gate | up per row
    expected = F.silu(g.view(2, -1)) * u.view(2, -1)
    torch.testing.assert_close(ops.silu_mul(gu), expected, rtol=2e-6, atol=1e-7)
    assert torch.equal(ops.silu_mul(gu), exp_approx_silu(g.view(2, -1)) * u.view(2, -1))
    gate, up = g.view(2, -1)[:, :1001], u.view(2, -1)[:, :1001]  # 62 vectors of 16, then 9 one by one
    assert torch.equal(ops.silu_mul(torch.cat([gate, up], dim=1)), exp_approx_silu(gate) * up)


def exp_approx_silu(g: torch.Tensor) -> torch.Tensor:
    """g / (1 + exp(-g)) with common.h's exp_approx, op for op in fp32: what silu_mul's vector
    lanes and its scalar tail must both give, to the bit."""
    f = torch.float32
    x = (-g).clamp(-87.3, 88.3)
    n = torch.floor(x * torch.tensor(1.44269504088896341, dtype=f) + 0.5)
    r = x - n * torch.tensor(0.693359375, dtype=f)
    r = r - n * torch.tensor(-2.12194440e-4, dtype=f)
    p = torch.full_like(r, 1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + torch.tensor(c, dtype=f)
    p = p * r * r + r + 1.0
    scale = ((n.to(torch.int32) + 127) << 23).view(f)
    return g / (1.0 + p * scale)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_rope_is_bit_identical_and_the_kv_lands_at_its_slots(ops: native.NativeOps, kv_dtype: torch.dtype) -> None:
    """bf16: each value rounded as torch rounds it, to nearest and ties to even (the value row of
    row 0 holds ties both ways, and values that round up into the next binade)."""
    model = LlamaModel(TINY, tiny_weights(), torch.float32)
    nh, nkv, d = TINY.num_heads, TINY.num_kv_heads, TINY.head_dim
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, TINY.q_size + 2 * TINY.kv_size, generator=gen)
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000 - (1 << 32), 0x3FFFFFFF, 0x3FFF8000, 0x40018000])
    ties = ties.to(torch.int32)
    qkv[0, TINY.q_size + TINY.kv_size : TINY.q_size + TINY.kv_size + 6] = ties.view(torch.float32)
    positions = torch.tensor([0, 1, 7, 100, 511, 3])
    slots = torch.tensor([9, 2, 30, 31, 0, 17])
    k_cache, v_cache = torch.zeros(32, nkv, d, dtype=kv_dtype), torch.zeros(32, nkv, d, dtype=kv_dtype)
    qk = qkv[:, : TINY.q_size + TINY.kv_size].reshape(6, nh + nkv, d)
    expected = model.rope(qk, model.cos[positions].unsqueeze(1), model.sin[positions].unsqueeze(1))
    v = qkv[:, TINY.q_size + TINY.kv_size :].reshape(6, nkv, d).clone()
    ops.rope_write(qkv, nh, nkv, positions, model.cos, model.sin, slots, k_cache, v_cache)
    assert torch.equal(qkv[:, : TINY.q_size + TINY.kv_size].reshape(6, nh + nkv, d), expected)
    assert torch.equal(k_cache[slots], expected[:, nh:].to(kv_dtype)) and torch.equal(v_cache[slots], v.to(kv_dtype))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("lens", [[1], [100], [5, 16, 17], [300, 7, 129, 64], [1000, 1], [1537, 512, 513], [700, 63]])
# heads, kv heads, head dim: SmolLM2's GQA; one q head a kv head; groups of 6 (tiles of 4 and 2)
# over two 64-wide chunks; a head narrower than the AVX-512 value tiles (the plain loops)
# (and a head the AVX2 loops take 8 dims at a time)
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 4, 64), (12, 2, 128), (4, 2, 16), (4, 2, 8)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])  # bf16: read as its values, widened
def test_decode_attention_reads_the_paged_cache(
    ops: native.NativeOps, lens: list[int], shape: tuple[int, int, int], kv_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(len(lens) * 1000 + sum(lens))
    bs, num_blocks = 16, 128
    nh, nkv, d = shape
    k_cache = torch.randn(num_blocks * bs, nkv, d, generator=gen).to(kv_dtype)
    v_cache = torch.randn(num_blocks * bs, nkv, d, generator=gen).to(kv_dtype)
    qkv = torch.randn(len(lens), (nh + 2 * nkv) * d, generator=gen)  # q read in place: a strided row
    tables = random_tables(gen, lens, num_blocks, bs)
    got = ops.decode_attention(qkv, nh, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens), bs)
    q = qkv[:, : nh * d].reshape(len(lens), nh, d)
    expected = dense_reference(q, k_cache, v_cache, tables, lens, bs)
    torch.testing.assert_close(got.view(len(lens), nh, d).double(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8"])  # int8: the integer kernels' roundings too
def test_a_rows_attention_is_the_same_bits_in_any_batch_and_on_any_thread_count(
    ops: native.NativeOps, kv_dtype: str
) -> None:
    """A row's keys split into segments by its own length alone (two from 64 keys on, so one row
    keeps two threads busy), so the step around it moves no bit: speculation's exactness rests on
    it (its draft rows verify in one step what later steps compute one by one)."""
    gen = torch.Generator().manual_seed(7)
    bs, num_blocks, (nh, nkv, d) = 16, 160, (9, 3, 64)
    k_cache = torch.randn(num_blocks * bs, nkv, d, generator=gen)
    v_cache = torch.randn(num_blocks * bs, nkv, d, generator=gen)
    if kv_dtype != "fp32":
        codec = KVCodec.of(kv_dtype, torch.float32)
        k_cache, v_cache = codec.encode(k_cache), codec.encode(v_cache)
    lens = [100, 700, 40, 300, 65]
    qkv = torch.randn(len(lens), (nh + 2 * nkv) * d, generator=gen)
    tables = torch.tensor(random_tables(gen, lens, num_blocks, bs))
    together = ops.decode_attention(qkv, nh, k_cache, v_cache, tables, torch.tensor(lens), bs)
    for i, n in enumerate(lens):
        alone = ops.decode_attention(qkv[i : i + 1], nh, k_cache, v_cache, tables[i : i + 1], torch.tensor([n]), bs)
        assert torch.equal(alone, together[i : i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = ops.decode_attention(qkv, nh, k_cache, v_cache, tables, torch.tensor(lens), bs)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, together)


class CountingOps(native.NativeOps):
    """The built ops, counting the steps that write the cache through them."""

    def __init__(self, built: native.NativeOps) -> None:
        super().__init__(built._lib)
        self.writes = 0

    def rope_write(self, *args: object, **kw: object) -> None:
        self.writes += 1
        super().rope_write(*args, **kw)  # type: ignore[arg-type]


# fp32 cache rows, bf16 ones widened as read, or int8 codes read in place
@pytest.mark.parametrize("kv_dtype", ["auto", "bf16", "int8"])
def test_the_models_decode_through_them_equals_its_torch_path(ops: native.NativeOps, kv_dtype: str) -> None:
    model = LlamaModel(TINY, tiny_weights(), torch.float32)
    assert model.native is ops
    prompts = [[5, 9, 11], list(range(1, 40)), [7] * 17, [100, 2]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    results = []
    counting = CountingOps(ops)
    for fused in (counting, None):
        model.native = fused
        results.append(generate_checked(model, prompts, params, kv_dtype=kv_dtype))
    assert counting.writes >= 24 * TINY.num_layers  # every step took the C ops (fp32 weights: layer by layer)
    for c_out, torch_out in zip(*results, strict=True):
        assert c_out.token_ids == torch_out.token_ids
        for a, b in zip(c_out.logprobs, torch_out.logprobs, strict=True):
            assert a is not None and b is not None
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


@pytest.mark.parametrize(
    "without",
    [("-mno-avx512vnni",), ("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")],
    ids=["avx512-no-vnni", "avx2", "plain"],
)
def test_without_avx512_or_vnni_the_older_kernels_give_the_same_results(
    tmp_path: Path, without: tuple[str, ...]
) -> None:
    """The C code as a CPU without AVX-512 VNNI runs it (AVX-512's float loops read int8 caches),
    without AVX-512 (AVX2), or without either: the int8 product the same bits, attention the same
    to rounding, over fp32, bf16 and int8 caches (with AVX2 alone the int8 ones summed in integers)."""
    if not HAS_CC:
        pytest.skip("no C compiler")
    path = native_build.build(tmp_path, os.environ.get("CC", "cc"), (*native_build.FLAGS, *without))
    plain = native.NativeOps(ctypes.CDLL(str(path)))
    gen = torch.Generator().manual_seed(4)
    qweight = torch.randint(-127, 128, (48, 64), dtype=torch.int8, generator=gen)
    scale = torch.rand(48, generator=gen) * 0.01 + 1e-4
    w = RowQuantWeight.from_int8(qweight, scale)
    assert w is not None
    for rows in (1, 2, 3, 6, 37):  # the AVX2 kernel's tiles of 1-2 rows x 1-2 blocks
        x = torch.randn(rows, 64, generator=gen) * 3
        assert torch.equal(plain.linear_i8(x, w), per_row_reference(x, qweight, scale))
    assert plain.linear_i8_fast == ("-mno-avx2" not in without and "avx2" in cpu_flags())
    k_cache, v_cache = torch.randn(64 * 16, 3, 64, generator=gen), torch.randn(64 * 16, 3, 64, generator=gen)
    lens = [300, 17]
    tables = torch.tensor(random_tables(gen, lens, 64, 16))
    qkv = torch.randn(2, 15 * 64, generator=gen)
    q = qkv[:, : 9 * 64].reshape(2, 9, 64)
    int8 = KVCodec.of("int8", torch.float32)
    k8, v8 = int8.encode(k_cache), int8.encode(v_cache)
    # fp32 and bf16 caches to 2e-5, as before; int8 ones read as their decoded values to 6e-5: as floats by
    # the plain loops, summed in integers with AVX2 (the query and the softmax weights rounded to
    # int16, which test_native_kv_int8.py holds to that rounding at 1e-5)
    avx2 = "-mno-avx2" not in without and {"avx2", "fma"} <= cpu_flags()
    avx512 = "-mno-avx512f" not in without and "avx512f" in cpu_flags()
    assert plain.decode_attention_int8_fast == (avx2 and not avx512)
    k16, v16 = k_cache.bfloat16(), v_cache.bfloat16()
    for k, v, keys, values, atol in ((k_cache, v_cache, k_cache, v_cache, 2e-5),
                                     (k16, v16, k16.float(), v16.float(), 2e-5),
                                     (k8, v8, int8.decode(k8), int8.decode(v8), 6e-5)):  # fmt: skip
        got = plain.decode_attention(qkv, 9, k, v, tables, torch.tensor(lens), 16)
        expected = dense_reference(q, keys, values, tables.tolist(), lens, 16)
        torch.testing.assert_close(got.view(2, 9, 64).double(), expected, atol=atol, rtol=1e-4)


def test_the_build_is_cached(tmp_path: Path) -> None:
    if not HAS_CC:
        pytest.skip("no C compiler")
    cc = os.environ.get("CC", "cc")
    first = native_build.build(tmp_path, cc)
    stamp = first.stat().st_mtime_ns
    assert native_build.build(tmp_path, cc) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


def test_without_a_compiler_the_engine_runs_its_torch_ops(
    fresh_ops: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="engine.native"):
        assert native.ops() is None
    assert "native decode ops unavailable" in caplog.text
    model = LlamaModel(TINY, tiny_weights(), torch.float32)
    assert model.native is None
    engine = make_engine(model, num_blocks=64)
    out = engine.generate([[5, 9, 11]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 8
    engine.check_integrity()


def test_tandem_native_0_turns_them_off(fresh_ops: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_NATIVE", "0")
    assert native.ops() is None
    assert LlamaModel(TINY, tiny_weights(), torch.float32).native is None


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # the fallback's, expected here
def test_an_int8_model_packs_fbgemm_at_load_only_where_its_steps_run_it(
    fresh_ops: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the per-row kernel every step takes it, and no projection holds fbgemm's copy; without
    the C ops every projection's copy is made at load, so no request waits for the packing."""
    kernels = quantized_model("int8")
    if kernels.per_row is not None:
        assert not any("_fbgemm" in vars(p) for p in kernels.projections())
    monkeypatch.setenv("TANDEM_NATIVE", "0")
    native.ops.cache_clear()
    torch_ops = quantized_model("int8")
    assert torch_ops.native is None and all("_fbgemm" in vars(p) for p in torch_ops.projections())
    out = make_engine(torch_ops, num_blocks=64).generate([[5, 9, 11]], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].token_ids) == 4

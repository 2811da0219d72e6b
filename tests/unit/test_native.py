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

from engine import native
from engine.kv_codec import KVCodec
from engine.linear import Projection, RowQuantWeight, cpu_flags
from engine.model import LlamaModel
from engine.sampling_params import SamplingParams
from tests.unit.conftest import HAS_CC
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


def test_rope_is_bit_identical_and_the_kv_lands_at_its_slots(ops: native.NativeOps) -> None:
    model = LlamaModel(TINY, tiny_weights(), torch.float32)
    nh, nkv, d = TINY.num_heads, TINY.num_kv_heads, TINY.head_dim
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, TINY.q_size + 2 * TINY.kv_size, generator=gen)
    positions = torch.tensor([0, 1, 7, 100, 511, 3])
    slots = torch.tensor([9, 2, 30, 31, 0, 17])
    k_cache, v_cache = torch.zeros(32, nkv, d), torch.zeros(32, nkv, d)
    qk = qkv[:, : TINY.q_size + TINY.kv_size].reshape(6, nh + nkv, d)
    expected = model.rope(qk, model.cos[positions].unsqueeze(1), model.sin[positions].unsqueeze(1))
    v = qkv[:, TINY.q_size + TINY.kv_size :].reshape(6, nkv, d).clone()
    ops.rope_write(qkv, nh, nkv, positions, model.cos, model.sin, slots, k_cache, v_cache)
    assert torch.equal(qkv[:, : TINY.q_size + TINY.kv_size].reshape(6, nh + nkv, d), expected)
    assert torch.equal(k_cache[slots], expected[:, nh:]) and torch.equal(v_cache[slots], v)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("lens", [[1], [100], [5, 16, 17], [300, 7, 129, 64], [1000, 1], [1537, 512, 513], [700, 63]])
# heads, kv heads, head dim: SmolLM2's GQA; one q head a kv head; groups of 6 (tiles of 4 and 2)
# over two 64-wide chunks; a head narrower than the AVX-512 value tiles (the plain loops)
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 4, 64), (12, 2, 128), (4, 2, 16)])
def test_decode_attention_reads_the_paged_cache(
    ops: native.NativeOps, lens: list[int], shape: tuple[int, int, int]
) -> None:
    gen = torch.Generator().manual_seed(len(lens) * 1000 + sum(lens))
    bs, num_blocks = 16, 128
    nh, nkv, d = shape
    k_cache = torch.randn(num_blocks * bs, nkv, d, generator=gen)
    v_cache = torch.randn(num_blocks * bs, nkv, d, generator=gen)
    qkv = torch.randn(len(lens), (nh + 2 * nkv) * d, generator=gen)  # q read in place: a strided row
    tables = random_tables(gen, lens, num_blocks, bs)
    got = ops.decode_attention(qkv, nh, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens), bs)
    q = qkv[:, : nh * d].reshape(len(lens), nh, d)
    expected = dense_reference(q, k_cache, v_cache, tables, lens, bs)
    torch.testing.assert_close(got.view(len(lens), nh, d).double(), expected, atol=2e-5, rtol=1e-4)


def test_a_rows_attention_is_the_same_bits_in_any_batch_and_on_any_thread_count(ops: native.NativeOps) -> None:
    """A row's keys split into segments by its own length alone (two from 64 keys on, so one row
    keeps two threads busy), so the step around it moves no bit: speculation's exactness rests on
    it (its draft rows verify in one step what later steps compute one by one)."""
    gen = torch.Generator().manual_seed(7)
    bs, num_blocks, (nh, nkv, d) = 16, 160, (9, 3, 64)
    k_cache = torch.randn(num_blocks * bs, nkv, d, generator=gen)
    v_cache = torch.randn(num_blocks * bs, nkv, d, generator=gen)
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


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])  # fp32 cache rows, or int8 codes read in place
def test_the_models_decode_through_them_equals_its_torch_path(ops: native.NativeOps, kv_dtype: str) -> None:
    model = LlamaModel(TINY, tiny_weights(), torch.float32)
    assert model.native is ops
    prompts = [[5, 9, 11], list(range(1, 40)), [7] * 17, [100, 2]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    results = []
    for fused in (ops, None):
        model.native = fused
        results.append(generate_checked(model, prompts, params, kv_dtype=kv_dtype))
    for c_out, torch_out in zip(*results, strict=True):
        assert c_out.token_ids == torch_out.token_ids
        for a, b in zip(c_out.logprobs, torch_out.logprobs, strict=True):
            assert a is not None and b is not None
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


def per_row_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """linear_i8's arithmetic in torch: each row rounded to int8 by its own max, exact integer
    dot products, then the two scales, in the C side's order."""
    amax = x.abs().amax(dim=1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(x * inv[:, None]).to(torch.int64)  # half to even, as nearbyintf
    dots = (q @ qweight.to(torch.int64).T).float()
    return dots * (amax / 127.0)[:, None] * scale.float()


# 7 blocks and 6 rows: split unevenly over 2 threads, a tile of 6 x 3 blocks and one of 6 x 4;
# 13 rows: tiles of 8 x 3 blocks, then 5 rows; 11 blocks and 8 rows: 8 x 3 tiles and an 8 x 2;
# 6 blocks and 37 rows: prefill's tall tiles (8 rows x 2 blocks), then 5 rows.
@pytest.mark.parametrize(("blocks", "rows"), [(7, 6), (7, 13), (11, 8), (6, 37)])
def test_int8_linear_is_the_per_row_product_bit_for_bit(ops: native.NativeOps, blocks: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(3)
    n, k = 16 * blocks, 96
    qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, generator=gen) * 0.01 + 1e-4
    w = RowQuantWeight.from_int8(qweight, scale)
    assert w is not None
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-3, 2, rows)[:, None]
    x[5] = 0.0  # a zero row: scale 0, output 0
    expected = per_row_reference(x, qweight, scale)
    assert torch.equal(ops.linear_i8(x, w), expected)
    # each row depends on itself alone: alone, in another batch, on one thread
    assert all(torch.equal(ops.linear_i8(x[i : i + 1], w), expected[i : i + 1]) for i in range(rows))
    assert torch.equal(ops.linear_i8(x.flip(0)[3:], w), expected.flip(0)[3:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ops.linear_i8(x, w), expected)
    finally:
        torch.set_num_threads(threads)
    # and it is the weight's product, to int8 rounding of the activations (relative to each row)
    exact = x @ (qweight.float() * scale[:, None]).T
    err = (expected - exact).abs().amax(dim=1) / exact.abs().amax(dim=1).clamp(min=1e-30)
    assert float(err.max()) < 0.05


@pytest.mark.parametrize("without", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")], ids=["avx2", "plain"])
def test_without_avx512_the_avx2_kernel_and_the_plain_loops_give_the_same_results(
    tmp_path: Path, without: tuple[str, ...]
) -> None:
    """The C code as a CPU without AVX-512 (or VNNI) runs it, with AVX2 or without: the int8
    product the same bits, attention the same to rounding, over fp32 caches and int8 ones."""
    if not HAS_CC:
        pytest.skip("no C compiler")
    path = native.build(tmp_path, os.environ.get("CC", "cc"), (*native.FLAGS, *without))
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
    # fp32 caches to 2e-5, as before; int8 ones read as their decoded values to 6e-5 (as
    # test_native_kv_int8.py holds them without VNNI)
    for k, v, keys, values, atol in ((k_cache, v_cache, k_cache, v_cache, 2e-5),
                                     (k8, v8, int8.decode(k8), int8.decode(v8), 6e-5)):  # fmt: skip
        got = plain.decode_attention(qkv, 9, k, v, tables, torch.tensor(lens), 16)
        expected = dense_reference(q, keys, values, tables.tolist(), lens, 16)
        torch.testing.assert_close(got.view(2, 9, 64).double(), expected, atol=atol, rtol=1e-4)


def test_a_weight_the_kernel_does_not_tile_keeps_fbgemm() -> None:
    assert RowQuantWeight.from_int8(torch.zeros(24, 8, dtype=torch.int8), torch.ones(24)) is None  # out % 16
    assert RowQuantWeight.from_int8(torch.zeros(32, 6, dtype=torch.int8), torch.ones(32)) is None  # in % 4
    minus_128 = torch.zeros(32, 8, dtype=torch.int8)
    minus_128[3, 5] = -128  # the AVX2 kernel's |a| . (w signed as a) would overflow
    assert RowQuantWeight.from_int8(minus_128, torch.ones(32)) is None
    assert Projection(torch.randn(24, 8), torch.float32, int8=True).rows is None
    assert Projection(torch.randn(32, 8), torch.float32).rows is None  # float weights: no copy


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # the fallback's, expected here
def test_fbgemms_copy_of_an_int8_weight_is_made_only_when_a_call_runs_it() -> None:
    """The per-row layout is an int8 projection's one copy of its values: fbgemm's packed copy
    (from a quantized tensor, deprecated in torch 2.13) waits for a call that needs it, and the
    values it is made from are the ones loaded, whether they tile the C kernel or not."""
    gen = torch.Generator().manual_seed(3)
    for out in (32, 24):  # tiles the per-row layout; does not (out % 16): fbgemm's alone
        w = torch.randn(out, 64, generator=gen)
        p = Projection(w, torch.float32, int8=True)
        assert "_fbgemm" not in vars(p) and (p.rows is None) == (out == 24)
        state = p.state("w")
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
        assert torch.equal(state["w.qweight"], torch.round(w / scale[:, None]).to(torch.int8))
        again = Projection.from_state(state, "w")
        assert all(torch.equal(a, b) for a, b in zip(again.state("w").values(), state.values(), strict=True))
        x = torch.randn(5, 64, generator=gen)
        expected = x @ (state["w.qweight"].float() * state["w.scale"].float()[:, None]).T
        # fbgemm quantizes the activations per tensor, to 7 bits: 3.5% of the largest output here
        torch.testing.assert_close(again(x), expected, atol=0.05 * expected.abs().max().item(), rtol=0)
        assert "_fbgemm" in vars(again)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_decode_rows_do_not_depend_on_their_batch_so_speculation_is_exact(
    ops: native.NativeOps, kind: str
) -> None:
    """The decode step's int8 matmuls quantize per row, so a verify step's extra rows leave the
    others' logits as they are: speculation on gives the tokens and logprobs of speculation off,
    bit for bit, in int8 too (through fbgemm's per-tensor kernel, the logprobs moved: checked
    when this was written)."""
    model = quantized_model(kind)
    assert model.native is ops and all(p.rows is not None or p.q4 is not None for p in model.projections())
    looping = [([(7 * i + 3 * j) % 120 + 1 for j in range(5)] * 6)[: 12 + 5 * i] for i in range(4)]
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True, logprobs=2)
    off = make_engine(model, num_blocks=128).generate(looping, params)
    spec = make_engine(model, num_blocks=128, speculative="ngram")
    on = spec.generate(looping, params)
    spec.check_integrity()
    assert spec.speculator is not None and 0 < spec.speculator.accepted < spec.speculator.drafted
    for a, b in zip(on, off, strict=True):
        assert a.token_ids == b.token_ids
        assert [(x.token_id, x.logprob) for x in a.logprobs if x] == [(x.token_id, x.logprob) for x in b.logprobs if x]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_prompt_prefills_alike_alone_and_beside_others(ops: native.NativeOps, kind: str) -> None:
    """Prefill's int8 matmuls quantize per row too (where AVX512-VNNI or AVX2 runs them): a prompt's tokens and
    logprobs do not depend on the prompts prefilled in the same step. Through fbgemm, whose one
    scale spans the whole step, they did (checked when this was written)."""
    if not ops.linear_i8_fast:
        pytest.skip("no AVX512-VNNI or AVX2: prefill keeps fbgemm")
    model = quantized_model(kind)
    assert model.per_row is ops
    prompt, others = list(range(3, 40)), [[100] * 9, [((i * 37) % 120) * 9 % 120 + 1 for i in range(60)]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    alone = make_engine(model, num_blocks=128).generate([prompt], params)[0]
    engine = make_engine(model, num_blocks=128)
    beside = engine.generate([others[0], prompt, others[1]], params)[1]
    engine.check_integrity()
    assert alone.token_ids == beside.token_ids
    assert [(x.token_id, x.logprob) for x in alone.logprobs if x] == [
        (x.token_id, x.logprob) for x in beside.logprobs if x
    ]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_decode_row_computes_alike_in_a_step_with_prefills(ops: native.NativeOps, kind: str) -> None:
    """A decode row that shares its step with prefill chunks attends in C as in a decode-only
    step, and (where AVX512-VNNI or AVX2 runs the per-row kernel for both) projects alike: its tokens and
    logprobs are the same bits as when it decodes alone, so served speculation and batching do
    not move a stream's text."""
    if not ops.linear_i8_fast:
        pytest.skip("no AVX512-VNNI or AVX2: steps with prefills project through fbgemm")
    model = quantized_model(kind)
    stream, params = (
        list(range(5, 30)),
        SamplingParams(max_tokens=24, temperature=0.7, seed=3, ignore_eos=True, logprobs=2),
    )
    alone = make_engine(model, num_blocks=128, max_prefill_chunk=8).generate([stream], params)[0]
    engine = make_engine(model, num_blocks=128, max_prefill_chunk=8)  # the stream's prompt chunked alike
    engine.add_request("stream", stream, params)
    tokens, logprobs, mixed = [], [], 0
    for i in range(200):
        if i in (3, 9):  # prompts arrive while the stream decodes: chunked, they share its steps
            engine.add_request(f"other{i}", [(j * 13 + i) % 120 + 1 for j in range(40)], params)
        if not engine.has_unfinished():
            break
        mixed += bool(engine.scheduler.requests.get("stream")) and i > 3
        for o in engine.step():
            if o.request_id == "stream":
                tokens += o.new_token_ids
                logprobs += [(x.token_id, x.logprob) for x in o.logprobs if x]
        engine.check_integrity()
    assert mixed and tokens == alone.token_ids
    assert logprobs == [(x.token_id, x.logprob) for x in alone.logprobs if x]


def test_the_build_is_cached(tmp_path: Path) -> None:
    if not HAS_CC:
        pytest.skip("no C compiler")
    cc = os.environ.get("CC", "cc")
    first = native.build(tmp_path, cc)
    stamp = first.stat().st_mtime_ns
    assert native.build(tmp_path, cc) == first and first.stat().st_mtime_ns == stamp
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

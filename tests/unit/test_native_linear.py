"""engine/csrc/linear_i8.c and linear_q4.c through engine/native.py: each activation row quantized
by itself, so a row's product is the same bits alone, in any batch and on any thread count, and
what that buys the engine (speculation and batching that move no token); and fbgemm's copy of an
int8 weight, kept only for what the C kernel cannot run."""

from __future__ import annotations

import pytest
import torch

from engine import native
from engine.linear import Projection, RowQuantWeight
from engine.sampling_params import SamplingParams
from tests.unit.tiny import make_engine, quantized_model


def per_row_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """linear_i8's arithmetic in torch: each row rounded to int8 by its own max, exact integer
    dot products, then the two scales, in the C side's order."""
    amax = x.abs().amax(dim=1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(x * inv[:, None]).to(torch.int64)  # half to even, as nearbyintf
    dots = (q @ qweight.to(torch.int64).T).float()
    return dots * (amax / 127.0)[:, None] * scale.float()


# 7 blocks and 6 rows: split unevenly over 2 threads, the 6 rows passing a block at a time;
# 13 rows: 8 rows, then 5; 11 blocks and 8 rows; 6 blocks and 37 rows: prefill's tall tiles
# (8 rows x 2 blocks), then 5 rows; each row alone: row_block. k = 100, a multiple of neither
# 8 nor 16: the few-row and one-row loops' tails, 4 inputs at a time.
@pytest.mark.parametrize(
    ("blocks", "rows", "k"), [(7, 6, 96), (7, 13, 96), (11, 8, 96), (6, 37, 96), (6, 20, 100), (5, 7, 100)]
)
def test_int8_linear_is_the_per_row_product_bit_for_bit(ops: native.NativeOps, blocks: int, rows: int, k: int) -> None:
    gen = torch.Generator().manual_seed(3)
    n = 16 * blocks
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

"""Coded KV caches (int8, fp8) and narrow float ones (bf16): the codec, the engine, the transfer."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from engine.config import EngineConfig
from engine.kv_codec import KVCodec, scales
from engine.model import LlamaModel
from engine.sampling_params import SamplingParams
from kv_transfer.errors import ChunkRejected
from kv_transfer.wire import checksum, tensor_bytes
from protos.gen import kv_transfer_pb2 as pb
from tests.unit.kv_harness import Pair, make_pair
from tests.unit.tiny import TINY, make_engine, quantized_model, tiny_weights

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
CODED = ["int8", "fp8"]


@pytest.mark.parametrize(("kind", "rel"), [("int8", 0.5 / 127), ("fp8", 1 / 16), ("bf16", 1 / 256)])
def test_codec_round_trip_error_is_bounded_per_token_and_head(kind: str, rel: float) -> None:
    x = torch.randn(50, 3, 16) * torch.logspace(-3, 3, 50).view(50, 1, 1)  # rows of very different sizes
    codec = KVCodec.of(kind, torch.float32)
    rows = codec.encode(x)
    assert rows.dtype == codec.storage and rows.shape[-1] == codec.width(16)
    err = (codec.decode(rows) - x).abs()
    bound = x.abs().amax(-1, keepdim=True) * rel * 1.0001  # int8: half a step of max|x| / 127
    assert (err <= bound).all()
    assert codec.decode(codec.encode(torch.zeros(2, 3, 16))).eq(0).all()  # an all-zero row stays zero


def test_auto_is_the_activation_dtype_but_bf16_under_quantized_weights_and_unknown_kinds_are_refused() -> None:
    assert KVCodec.of("auto", torch.bfloat16).kind == "bf16" and KVCodec.of("auto", torch.float32).passthrough
    assert not KVCodec.of("bf16", torch.float32).passthrough
    assert KVCodec.of("auto", torch.float32, quantized=True).kind == "bf16"
    assert KVCodec.of("auto", torch.bfloat16, quantized=True).kind == "bf16"
    assert KVCodec.of("fp32", torch.float32, quantized=True).kind == "fp32"  # asked for: as asked
    for weights in ("int8", "int4"):
        assert make_engine(quantized_model(weights), num_blocks=8).cache.dtype == torch.bfloat16
    assert make_engine(LlamaModel(TINY, tiny_weights(), torch.float32), num_blocks=8).cache.dtype == torch.float32
    # as the startup line says it, before any engine is built
    assert [EngineConfig(dtype=d).kv_storage for d in ("fp32", "int8", "int4")] == ["fp32", "bf16", "bf16"]
    assert EngineConfig(dtype="int8", kv_dtype="int8").kv_storage == "int8"
    with pytest.raises(ValueError, match="kv_dtype"):
        EngineConfig(kv_dtype="int4")


@pytest.mark.parametrize("kv_dtype", ["bf16", *CODED])
def test_engine_on_a_coded_cache(tiny_model: LlamaModel, kv_dtype: str) -> None:
    """Chunking and prefix hits read coded context, and a chunk's own keys are read back coded
    too: so chunked == unchunked, and a prefix hit == a miss, exactly, as in a float cache."""
    prompts = [[random.Random(s).randrange(128) for _ in range(21 + 5 * s)] for s in range(4)]
    whole = make_engine(tiny_model, num_blocks=128, kv_dtype=kv_dtype, enable_prefix_caching=False)
    chunked = make_engine(tiny_model, num_blocks=128, kv_dtype=kv_dtype, max_num_batched_tokens=8)
    expected = [r.token_ids for r in whole.generate(prompts, GREEDY)]
    assert [r.token_ids for r in chunked.generate(prompts, GREEDY)] == expected
    assert [r.token_ids for r in chunked.generate(prompts, GREEDY)] == expected  # all prefix hits now
    assert chunked.cache.kv.dtype == KVCodec.of(kv_dtype, torch.float32).storage
    chunked.check_integrity()
    whole.check_integrity()


def pair_of(kv_dtype: str, tiny_model: LlamaModel) -> Iterator[Pair]:
    kv = {"kv_dtype": kv_dtype}
    p = make_pair(tiny_model, max_num_batched_tokens=8, decode_kw=kv, **kv)
    yield p
    p.close()


@pytest.fixture(params=CODED)
def coded_pair(request: pytest.FixtureRequest, tiny_model: LlamaModel) -> Iterator[Pair]:
    yield from pair_of(request.param, tiny_model)


@pytest.fixture(params=["bf16", *CODED])  # bf16: `auto` with quantized weights
def narrow_pair(request: pytest.FixtureRequest, tiny_model: LlamaModel) -> Iterator[Pair]:
    yield from pair_of(request.param, tiny_model)


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_narrow_blocks_arrive_bit_identical(narrow_pair: Pair, tiny_model: LlamaModel, transport: str) -> None:
    pair, kv_dtype = narrow_pair, narrow_pair.decode.config.kv_dtype
    client = pair.client(transport)
    prompt = [random.Random(7).randrange(128) for _ in range(37)]
    first, res, src = pair.transfer(client, "r", prompt, GREEDY)
    pair.receiver.wait("r", 2.0)
    dst = pair.decode.cache.read_blocks(list(res.block_ids))
    assert dst.dtype == src.dtype and torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    if kv_dtype in CODED:
        assert (scales(dst) >= 0).all() and (scales(dst) > 0).any()
    pair.receiver.admit("r", prompt, first.new_token_ids[0], GREEDY)
    got: list[int] = []
    while pair.decode.has_unfinished():
        with pair.lock:
            got += [t for o in pair.decode.step() for t in o.new_token_ids]
    alone = make_engine(tiny_model, num_blocks=64, kv_dtype=kv_dtype, max_num_batched_tokens=8)
    assert got == alone.generate([prompt], GREEDY)[0].token_ids
    pair.receiver.check_integrity()
    pair.prefill.check_integrity()
    assert pair.decode.kv.num_free_blocks == 256
    client.close()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_chunk_with_a_bad_scale_is_rejected_and_writes_nothing(coded_pair: Pair, bad: float) -> None:
    pair = coded_pair
    res = pair.receiver.reserve("r", 10)
    cache = pair.decode.cache
    codec = cache.codec
    rows = codec.encode(torch.randn(1, 2, 2, 4, TINY.num_kv_heads, TINY.head_dim))
    rows[0, 1, 1, 2, 0, -4:] = torch.tensor([bad]).view(codec.storage)
    h = pb.KVChunkHeader(
        request_id="r",
        transfer_token=res.transfer_token,
        layer_start=0,
        layer_end=1,
        block_ids=list(res.block_ids[:2]),
        dtype=res.layout.dtype,
        shape=list(rows.shape),
        payload_bytes=rows.numel(),
        transport="grpc",
        checksum=checksum(tensor_bytes(rows)),
    )
    before = cache.kv.clone()
    with pytest.raises(ChunkRejected) as err:
        pair.receiver.accept(h, tensor_bytes(rows))
    assert err.value.code == "bad_scales"
    assert torch.equal(cache.kv.view(torch.uint8), before.view(torch.uint8))
    assert "r" not in pair.receiver.table
    pair.receiver.check_integrity()
    assert pair.decode.kv.num_free_blocks == 256

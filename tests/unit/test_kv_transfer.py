"""KV transfer over real gRPC on loopback: exact round trips, concurrency, rejections, leases."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from engine.model import LayerCallback, LlamaModel
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from kv_transfer.errors import ChunkRejected, KVTransferError
from kv_transfer.wire import checksum, tensor_bytes
from protos.gen import kv_transfer_pb2 as pb
from tests.unit.kv_harness import Pair, make_pair, wait_for
from tests.unit.tiny import TINY, make_engine

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture
def pair(tiny_model: LlamaModel) -> Iterator[Pair]:
    p = make_pair(tiny_model, max_num_batched_tokens=8)  # several chunks per prompt
    yield p
    p.close()


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(n)]


def decode_all(pair: Pair, rid: str) -> list[int]:
    tokens: list[int] = []
    while pair.decode.has_unfinished():
        with pair.lock:
            outs = pair.decode.step()
        tokens += [t for o in outs if o.request_id == rid for t in o.new_token_ids]
    return tokens


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_exact_round_trip_and_same_tokens(pair: Pair, tiny_model: LlamaModel, transport: str) -> None:
    client = pair.client(transport)
    for seed, n in ((1, 5), (2, 16), (3, 37)):
        prompt = prompt_of(n, seed)
        first, res, src = pair.transfer(client, f"r{seed}", prompt, GREEDY)
        stats = pair.receiver.wait(f"r{seed}", 2.0)
        assert stats.bytes > 0 and stats.chunks >= 2
        dst = pair.decode.cache.read_blocks(list(res.block_ids))
        assert torch.equal(src, dst), "decode blocks differ from prefill blocks"
        pair.receiver.admit(f"r{seed}", prompt, first.new_token_ids[0], GREEDY)
        got = decode_all(pair, f"r{seed}")
        alone = make_engine(tiny_model, num_blocks=64).generate([prompt], GREEDY)[0].token_ids
        assert got == alone
        pair.receiver.check_integrity()
        pair.prefill.check_integrity()
    assert pair.decode.kv.num_free_blocks == 256 and pair.prefill.kv.num_requests == 0
    client.close()


def test_sixteen_concurrent_transfers_land_in_their_own_blocks(tiny_model: LlamaModel) -> None:
    decode_pair = make_pair(tiny_model)
    client = decode_pair.client()
    try:
        errors: list[BaseException] = []
        results: dict[str, tuple[list[int], torch.Tensor]] = {}

        def one(i: int) -> None:
            try:
                rid = f"c{i}"
                n = 3 + 7 * i
                layers = tiny_model.config.num_layers
                data = torch.randn(layers, 2, -(-n // 4), 4, 2, 16)
                res = client.reserve(rid, n)
                push = client.push(rid, res)
                for layer in range(layers):
                    push.send(layer, layer + 1, list(range(data.shape[2])), data[layer : layer + 1].contiguous())
                push.commit(n)
                results[rid] = (list(res.block_ids), data)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not errors, errors
        all_blocks = [b for blocks, _ in results.values() for b in blocks]
        assert len(all_blocks) == len(set(all_blocks))
        for blocks, data in results.values():
            assert torch.equal(decode_pair.decode.cache.read_blocks(blocks), data)
        decode_pair.receiver.check_integrity()
        for rid in results:
            assert decode_pair.receiver.release(rid, None, "test done")
        assert decode_pair.decode.kv.num_free_blocks == 256
    finally:
        client.close()
        decode_pair.close()


def _valid_chunk(res: pb.ReserveResponse, rid: str) -> tuple[pb.KVChunkHeader, torch.Tensor]:
    data = torch.randn(1, 2, 2, 4, 2, 16)
    h = pb.KVChunkHeader(
        request_id=rid,
        transfer_token=res.transfer_token,
        layer_start=0,
        layer_end=1,
        block_ids=list(res.block_ids[:2]),
        dtype="float32",
        shape=list(data.shape),
        payload_bytes=data.numel() * 4,
        transport="grpc",
        checksum=checksum(tensor_bytes(data)),
    )
    return h, data


BAD_CHUNKS = {
    "bad_token": lambda h, d: (setattr(h, "transfer_token", "0" * 32), d),
    "bad_blocks": lambda h, d: (h.block_ids.__setitem__(1, 250), d),
    "bad_dtype": lambda h, d: (setattr(h, "dtype", "bfloat16"), d),
    "bad_shape": lambda h, d: (h.shape.__setitem__(3, 8), d),
    "bad_checksum": lambda h, d: (setattr(h, "checksum", h.checksum ^ 1), d),
    "bad_layers": lambda h, d: (setattr(h, "layer_end", 9), d),
    "unknown_request": lambda h, d: (setattr(h, "request_id", "nobody"), d),
}


@pytest.mark.parametrize("case", sorted(BAD_CHUNKS))
def test_bad_chunks_are_rejected_and_write_nothing(pair: Pair, case: str) -> None:
    res = pair.receiver.reserve("r", 10)
    before = pair.decode.cache.kv.clone()
    h, data = _valid_chunk(res, "r")
    BAD_CHUNKS[case](h, data)
    with pytest.raises(ChunkRejected) as err:
        pair.receiver.accept(h, tensor_bytes(data))
    assert err.value.code == case
    assert torch.equal(pair.decode.cache.kv, before)
    still_reserved = case in ("bad_token", "unknown_request")
    assert ("r" in pair.receiver.table) == still_reserved
    pair.receiver.check_integrity()
    pair.receiver.release("r", None, "cleanup")
    assert pair.decode.kv.num_free_blocks == 256


def test_bad_chunk_over_grpc_is_a_typed_error_for_the_sender(pair: Pair) -> None:
    client = pair.client()
    res = client.reserve("r", 10)
    push = client.push("r", res)
    push.send(0, 1, [0, 1], torch.randn(1, 2, 2, 8, 2, 16))  # blocks of 8 tokens: the receiver's hold 4
    with pytest.raises(ChunkRejected) as err:
        push.commit(10)
    assert "bad_shape" in str(err.value)
    assert "r" not in pair.receiver.table
    assert pair.decode.kv.num_free_blocks == 256
    pair.receiver.check_integrity()
    client.close()


def test_reused_token_is_rejected(pair: Pair) -> None:
    old = pair.receiver.reserve("r", 8)
    pair.receiver.release("r", old.transfer_token, "first attempt abandoned")
    pair.receiver.reserve("r", 8)
    h, data = _valid_chunk(old, "r")
    with pytest.raises(ChunkRejected) as err:
        pair.receiver.accept(h, tensor_bytes(data))
    assert err.value.code == "bad_token"


def test_incomplete_commit_fails_and_frees(pair: Pair) -> None:
    client = pair.client()
    res = client.reserve("r", 8)
    push = client.push("r", res)
    push.send(0, 1, [0, 1], torch.randn(1, 2, 2, 4, 2, 16))  # layer 1 never sent
    with pytest.raises(ChunkRejected):
        push.commit(8)
    with pytest.raises(KVTransferError):
        pair.receiver.wait("r", 1.0)
    assert pair.decode.kv.num_free_blocks == 256
    client.close()


def test_lease_expires_and_frees_blocks(tiny_model: LlamaModel) -> None:
    p = make_pair(tiny_model, lease_s=0.3)
    try:
        p.receiver.reserve("idle", 20)
        assert p.decode.kv.num_free_blocks == 256 - 5
        deadline = time.monotonic() + 3
        while "idle" in p.receiver.table and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "idle" not in p.receiver.table
        assert p.decode.kv.num_free_blocks == 256
        with pytest.raises(KVTransferError, match="lease expired"):
            p.receiver.wait("idle", 0.1)
        p.receiver.check_integrity()
    finally:
        p.close()


def test_a_renewed_lease_outlives_its_first_term_and_a_gone_one_says_so(tiny_model: LlamaModel) -> None:
    """The router renews a reservation while it watches the prefill (cluster.handoff): the lease
    then lasts from the last renewal, never shorter than it was; a renewal of nothing is False."""
    p = make_pair(tiny_model, lease_s=0.3)
    try:
        p.receiver.reserve("queued", 20)
        assert p.receiver.renew("queued", 1.5)
        assert p.receiver.renew("queued", 0.01)  # a shorter renewal keeps the longer lease
        time.sleep(0.5)  # past the first term
        assert p.receiver.expire() == [] and "queued" in p.receiver.table
        p.receiver.check_integrity()
        assert not p.receiver.renew("never reserved", 5.0)
        assert wait_for(lambda: "queued" not in p.receiver.table, 3), "the renewed lease ran out too"
        assert p.decode.kv.num_free_blocks == 256
        p.receiver.check_integrity()
    finally:
        p.close()


def test_abort_from_the_sender_frees_the_reservation(pair: Pair) -> None:
    client = pair.client()
    res = client.reserve("r", 8)
    push = client.push("r", res)
    push.send(0, 1, [0, 1], torch.randn(1, 2, 2, 4, 2, 16))
    t = time.monotonic()
    push.abort("client went away")
    assert time.monotonic() - t < 0.05, "abort waited on the network"
    assert wait_for(lambda: pair.decode.kv.num_free_blocks == 256, 2)
    assert "r" not in pair.receiver.table
    pair.receiver.check_integrity()
    with pytest.raises(KVTransferError, match="client went away"):
        push.commit(8)
    client.close()


def test_an_engine_abort_leaves_a_reservation_to_the_receiver(pair: Pair) -> None:
    """An abort that reaches the engine before the router's release (they ride different lanes
    of the worker) freed a leased reservation's blocks behind the receiver: the lease outlived
    its blocks, which a late chunk could then write under another request."""
    pair.receiver.reserve("r", 8)
    with pair.lock:
        assert not pair.decode.abort("r"), "a reservation is not a request"
    pair.receiver.check_integrity()  # the lease still holds its blocks
    assert pair.receiver.release("r", None, "released by caller")
    assert pair.decode.kv.num_free_blocks == 256 and "r" not in pair.receiver.table
    pair.receiver.check_integrity()


def test_no_free_blocks_is_a_typed_error(pair: Pair) -> None:
    client = pair.client()
    client.reserve("a", 500)
    client.reserve("b", 500)
    with pytest.raises(KVTransferError, match="no free blocks"):
        client.reserve("c", 100)
    client.close()


def test_small_layers_go_several_to_a_message_bit_identical(tiny_model: LlamaModel) -> None:
    """A short prompt's layers are small: the streamer sends them together, at least
    min_message_bytes a message (the last message takes what is left)."""
    for min_bytes, chunks in ((1, TINY.num_layers), (10**9, 1)):
        pair = make_pair(tiny_model, min_message_bytes=min_bytes)
        try:
            prompt = prompt_of(9, 7)
            first, res, src = pair.transfer(pair.client(), "short", prompt, GREEDY)
            stats = pair.receiver.wait("short", 2.0)
            assert stats.chunks == chunks
            assert torch.equal(pair.decode.cache.read_blocks(list(res.block_ids)), src)
            pair.receiver.admit("short", prompt, first.new_token_ids[0], GREEDY)
            assert (
                decode_all(pair, "short")
                == make_engine(tiny_model, num_blocks=64).generate([prompt], GREEDY)[0].token_ids
            )
            pair.receiver.check_integrity()
            pair.prefill.check_integrity()
        finally:
            pair.close()


def test_a_hand_off_in_a_failed_step_streams_its_kv_again_whole(tiny_model: LlamaModel) -> None:
    """engine/containment.py runs a failed step's requests again, alone: the innocent hand-off's
    chunk goes again whole, the blocks its prefix-cache hit supplied included. The fault comes in
    at the engine's layer hook, after the streamer sent every request's first layer."""
    pair = make_pair(tiny_model)
    try:
        client = pair.client()
        shared = prompt_of(12, 5)
        pair.transfer(client, "warm", shared, GREEDY)  # its 3 full blocks stay in the prefix cache
        pair.receiver.admit("warm", shared, 0, GREEDY)
        decode_all(pair, "warm")
        streamer_hook = pair.streamer.hook

        def hook(out: SchedulerOutput) -> LayerCallback | None:
            send = streamer_hook(out)
            if not any(c.request.request_id == "bad" for c in out.chunks):
                return send

            def on_layer(i: int) -> None:
                if send is not None:
                    send(i)
                raise RuntimeError("poisoned step")

            return on_layer

        pair.prefill.layer_hook = hook
        prompts = {"bad": prompt_of(9, 6), "ok": shared + prompt_of(5, 7)}
        pushes = {}
        for rid, prompt in prompts.items():
            pushes[rid] = client.push(rid, client.reserve(rid, len(prompt)))
            pair.streamer.track(rid, pushes[rid])
            pair.prefill.add_request(rid, prompt, GREEDY)
        firsts = {}
        while pair.prefill.has_unfinished():
            firsts |= {o.request_id: o for o in pair.prefill.step()}
        assert firsts["bad"].finish_reason == "error" and firsts["ok"].num_cached_tokens == 12
        pushes["bad"].abort("its prefill failed")
        for rid in prompts:
            pair.streamer.untrack(rid)
        pushes["ok"].commit(len(prompts["ok"]))  # every layer of every block: "incomplete" before
        pair.prefill.release("ok")
        pair.receiver.admit("ok", prompts["ok"], firsts["ok"].new_token_ids[0], GREEDY)
        alone = make_engine(tiny_model, num_blocks=64).generate([prompts["ok"]], GREEDY)[0].token_ids
        assert decode_all(pair, "ok") == alone  # its first token, sampled by the prefill side, first
        assert wait_for(lambda: "bad" not in pair.receiver.table, 2), "the failed hand-off's reservation freed"
        pair.receiver.check_integrity()
        pair.prefill.check_integrity()
    finally:
        pair.close()

"""The collective transport between two real processes: gloo on CPU here, NCCL on two GPUs.

This process is the prefill side (rank 0, sender); a spawned process runs the decode side
(engine, KVReceiver, gRPC server, rank 1) and answers commands over a pipe. Every wait is
bounded: pipe polls, joins and the link's own timeouts.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from engine.model import LlamaModel
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from kv_transfer.collective import RECEIVER, SENDER, CollectiveLink, CollectiveReader, CollectiveWriter, LinkConfig
from kv_transfer.errors import ChunkRejected, KVTransferError, PeerUnavailable, TransferTimeout
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVTransferClient
from kv_transfer.server import KVTransferServer
from kv_transfer.streaming import LayerStreamer
from kv_transfer.wire import checksum, frame, tensor_bytes
from protos.gen import kv_transfer_pb2 as pb
from tests.ports import free_port
from tests.unit.tiny import TINY, make_engine, tiny_weights

NUM_BLOCKS = 64
TIMEOUT_S = 5.0
SECRET = "test-cluster-secret"  # the tests Reserve over gRPC, which needs it
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
CHUNK = (1, 2, 2, 4, 2, 16)  # one layer of two blocks: [layers, 2, blocks, block_size, kv_heads, head_dim]
SPAWN = mp.get_context("spawn")


# ---- the decode process --------------------------------------------------------------------


def decode_main(conn: Connection, port: int, backend: str, cuda_device: int) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(cuda_device)
    engine = make_engine(LlamaModel(TINY, tiny_weights(), torch.float32), num_blocks=NUM_BLOCKS, role="decode")
    lock = threading.RLock()
    receiver = KVReceiver(engine, lock, lease_s=10)
    server = KVTransferServer(receiver, secret=SECRET).start()
    conn.send(server.endpoint)
    link = CollectiveLink.connect(LinkConfig(port, backend=backend, timeout_s=TIMEOUT_S), RECEIVER)
    receiver.readers["collective"] = CollectiveReader(link)

    def decode(rid: str, prompt: list[int], first: int) -> list[int]:
        receiver.admit(rid, prompt, first, GREEDY)
        tokens: list[int] = []
        while engine.has_unfinished():
            with lock:
                tokens += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
        return tokens

    def state() -> tuple[int, list[str]]:
        receiver.check_integrity()
        return engine.kv.num_free_blocks, receiver.table.ids()

    commands: dict[str, Any] = {
        "wait": lambda rid: receiver.wait(rid, TIMEOUT_S).chunks,
        "blocks": lambda ids: engine.cache.read_blocks(ids).numpy(),
        "kv_checksum": lambda: checksum(tensor_bytes(engine.cache.kv)),
        "state": state,
        "decode": decode,
    }
    while conn.poll(60):  # the test went away: exit
        cmd, args = conn.recv()
        if cmd == "stop":
            break
        try:
            conn.send(("ok", commands[cmd](*args)))
        except Exception as e:
            conn.send(("err", f"{type(e).__name__}: {e}"))
    server.stop(0)


class Decode:
    """The decode process, the sending end of its link and a client that pushes over it."""

    def __init__(self, backend: str = "gloo", cuda_device: int = 0) -> None:
        port = free_port()
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=decode_main, args=(child, port, backend, cuda_device), daemon=True)
        self.proc.start()
        try:
            assert self.conn.poll(60), "decode process did not start"
            endpoint = self.conn.recv()
            self.link = CollectiveLink.connect(LinkConfig(port, backend=backend, timeout_s=TIMEOUT_S), SENDER)
            self.client = KVTransferClient(endpoint, "collective", timeout_s=TIMEOUT_S, link=self.link, secret=SECRET)
        except BaseException:
            self.proc.kill()
            raise

    def call(self, cmd: str, *args: Any) -> Any:
        self.conn.send((cmd, args))
        assert self.conn.poll(30), f"decode process did not answer {cmd!r}"
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"decode process: {value}")
        return value

    def blocks(self, ids: list[int]) -> torch.Tensor:
        return torch.from_numpy(self.call("blocks", ids))

    def close(self) -> None:
        self.client.close()
        if self.proc.is_alive():
            self.conn.send(("stop", ()))
            self.proc.join(10)
        self.proc.kill()
        self.proc.join(5)
        self.link.close()


@pytest.fixture(scope="module")
def decode() -> Iterator[Decode]:
    d = Decode()
    yield d
    d.close()


def assert_clean(d: Decode) -> None:
    """Every reservation gone, every block free, and nothing left unsettled on the link."""
    assert d.call("state") == (NUM_BLOCKS, [])
    assert d.link.num_inflight == 0


def chunk(res: pb.ReserveResponse, rid: str, data: torch.Tensor) -> pb.KVChunkHeader:
    return pb.KVChunkHeader(
        request_id=rid,
        transfer_token=res.transfer_token,
        layer_start=0,
        layer_end=1,
        block_ids=list(res.block_ids[:2]),
        dtype="float32",
        shape=list(data.shape),
        payload_bytes=data.numel() * 4,
        checksum=checksum(tensor_bytes(data)),
    )


def prefill_and_push(
    client: KVTransferClient, prefill: LayerStreamer, rid: str, prompt: list[int]
) -> tuple[RequestOutput, pb.ReserveResponse, torch.Tensor]:
    """Prefill `prompt` streaming layer by layer over `client`, commit; the hand-off output,
    the reservation and the prefill side's blocks."""
    engine = prefill.engine
    res = client.reserve(rid, len(prompt))
    push = client.push(rid, res)
    prefill.track(rid, push)
    engine.add_request(rid, prompt, GREEDY)
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    (first,) = outs
    assert first.kv is not None
    src = engine.cache.read_blocks(first.kv.block_ids)
    prefill.untrack(rid)
    push.commit(len(prompt))
    engine.release(rid)
    return first, res, src


# ---- tests ---------------------------------------------------------------------------------


def test_prefill_to_decode_is_bit_identical_and_decodes_the_same(decode: Decode, tiny_model: LlamaModel) -> None:
    prefill = make_engine(tiny_model, num_blocks=NUM_BLOCKS, role="prefill", max_num_batched_tokens=8)
    streamer = LayerStreamer(prefill, min_message_bytes=1)  # a message a layer
    for seed, n in ((1, 5), (2, 37)):
        rng = random.Random(seed)
        prompt = [rng.randrange(TINY.vocab_size) for _ in range(n)]
        first, res, src = prefill_and_push(decode.client, streamer, f"r{seed}", prompt)
        assert decode.call("wait", f"r{seed}") >= TINY.num_layers
        assert torch.equal(decode.blocks(list(res.block_ids)), src)
        got = decode.call("decode", f"r{seed}", prompt, first.new_token_ids[0])
        alone = make_engine(tiny_model, num_blocks=NUM_BLOCKS).generate([prompt], GREEDY)[0].token_ids
        assert got == alone
        assert_clean(decode)
    prefill.check_integrity()


def test_interleaved_pushes_share_the_link_in_order(decode: Decode) -> None:
    """Eight threads push at once: payloads reach the link in one order, headers in another."""
    results: dict[str, tuple[pb.ReserveResponse, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            rid, n = f"c{i}", 4 + 5 * i
            data = torch.randn(TINY.num_layers, 2, -(-n // 4), 4, 2, 16)
            res = decode.client.reserve(rid, n)
            push = decode.client.push(rid, res)
            for layer in range(TINY.num_layers):
                push.send(layer, layer + 1, list(range(data.shape[2])), data[layer : layer + 1].contiguous())
            push.commit(n)
            results[rid] = (res, data)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    assert len(results) == 8
    for rid, (res, data) in results.items():
        assert decode.call("wait", rid) == TINY.num_layers
        assert torch.equal(decode.blocks(list(res.block_ids)), data)
        assert decode.client.release(rid, res.transfer_token, "test done")  # random KV: free, don't decode
    assert_clean(decode)


def test_checksum_mismatch_is_rejected_and_writes_nothing(decode: Decode) -> None:
    before = decode.call("kv_checksum")
    res = decode.client.reserve("bad", 8)
    push = decode.client.push("bad", res)
    data = torch.randn(*CHUNK)
    h = chunk(res, "bad", data)
    inband = CollectiveWriter(decode.link).put(h, data)
    h.checksum ^= 1
    push.send_frame(frame(h, inband))
    with pytest.raises(ChunkRejected, match="checksum"):
        push.commit(8)
    assert decode.call("kv_checksum") == before
    assert decode.call("state") == (NUM_BLOCKS, [])
    ok = decode.client.reserve("after", 8)  # the link is still in order
    push = decode.client.push("after", ok)
    data = torch.randn(*CHUNK)
    for layer in range(TINY.num_layers):
        push.send(layer, layer + 1, [0, 1], data)
    push.commit(8)
    assert torch.equal(decode.blocks(list(ok.block_ids)), torch.cat([data] * TINY.num_layers))
    decode.client.release("after", ok.transfer_token, "test done")
    assert_clean(decode)


def test_a_payload_whose_chunk_is_refused_unread_does_not_desync_the_link(decode: Decode) -> None:
    res = decode.client.reserve("refused", 8)
    push = decode.client.push("refused", res)
    push.send(0, 1, [0, 1], torch.randn(*CHUNK))
    data = torch.randn(*CHUNK)
    h = chunk(res, "refused", data)
    CollectiveWriter(decode.link).put(h, data)
    h.shape[3] = 8  # refused before the receiver reads the payload: it stays in the stream
    push.send_frame(frame(h))
    with pytest.raises(ChunkRejected):
        push.commit(8)
    assert decode.link.num_inflight >= 1
    ok = decode.client.reserve("next", 8)
    push = decode.client.push("next", ok)
    data = torch.randn(*CHUNK)
    for layer in range(TINY.num_layers):
        push.send(layer, layer + 1, [0, 1], data)
    push.commit(8)  # its first read pulls the orphan through: its sends settle too
    assert torch.equal(decode.blocks(list(ok.block_ids)), torch.cat([data] * TINY.num_layers))
    decode.client.release("next", ok.transfer_token, "test done")
    assert_clean(decode)


def test_a_dead_decode_peer_is_a_typed_error_within_seconds() -> None:
    d = Decode()
    try:
        res = d.client.reserve("victim", 16)
        push = d.client.push("victim", res, deadline_s=TIMEOUT_S)
        push.send(0, 1, [0, 1], torch.randn(*CHUNK))
        d.proc.kill()
        d.proc.join(5)
        t = time.monotonic()
        with pytest.raises((PeerUnavailable, TransferTimeout)):
            for layer in range(TINY.num_layers):
                push.send(layer, layer + 1, [0, 1], torch.randn(*CHUNK))
            push.commit(16)
        assert time.monotonic() - t < 4
        assert d.link.num_inflight > 0  # posted to the dead peer before gRPC noticed
        with pytest.raises(PeerUnavailable):
            d.link.settle(1 << 62)  # a wait on them fails at once, typed
        with pytest.raises(PeerUnavailable, match="broken"):
            d.link.send(torch.zeros(4))  # and the link says so from then on
    finally:
        d.close()


def sender_dies_main(port: int) -> None:
    CollectiveLink.connect(LinkConfig(port, timeout_s=TIMEOUT_S), SENDER)
    os._exit(0)  # gone without a word, as in a crash


def test_a_dead_sender_is_a_typed_error_for_the_receiver() -> None:
    port = free_port()
    proc = SPAWN.Process(target=sender_dies_main, args=(port,), daemon=True)
    proc.start()
    try:
        link = CollectiveLink.connect(LinkConfig(port, timeout_s=TIMEOUT_S), RECEIVER)
        proc.join(10)
        t = time.monotonic()
        with pytest.raises(PeerUnavailable):
            link.recv(0)
        assert time.monotonic() - t < 2
        with pytest.raises(PeerUnavailable, match="broken"):
            link.recv(0)
        link.close()
    finally:
        proc.kill()
        proc.join(5)


def test_no_peer_is_a_typed_error_after_the_timeout() -> None:
    t = time.monotonic()
    with pytest.raises(KVTransferError):
        CollectiveLink.connect(LinkConfig(free_port(), timeout_s=0.5), SENDER)
    assert time.monotonic() - t < 3


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="backend"):
        LinkConfig(1234, backend="mpi")
    with pytest.raises(ValueError, match="CollectiveLink"):
        KVTransferClient("127.0.0.1:1", "collective")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (it refuses two ranks on one)")
def test_nccl_between_two_gpus_is_bit_identical() -> None:
    torch.cuda.set_device(0)
    d = Decode(backend="nccl", cuda_device=1)
    try:
        assert d.link.device.type == "cuda"
        res = d.client.reserve("g", 8)
        push = d.client.push("g", res)
        data = torch.randn(*CHUNK)
        for layer in range(TINY.num_layers):
            push.send(layer, layer + 1, [0, 1], data)
        push.commit(8)
        assert torch.equal(d.blocks(list(res.block_ids)), torch.cat([data] * TINY.num_layers))
        d.client.release("g", res.transfer_token, "test done")
        assert_clean(d)
    finally:
        d.close()

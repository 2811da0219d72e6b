"""Who may call the KV server, and what it refuses: secrets, tokens, sizes, stream limits, TLS.

Real gRPC on loopback. Raw calls (a channel with no client around it) play the attacker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.model import LlamaModel
from kv_transfer.errors import ChunkRejected, KVTransferError, PeerUnavailable
from kv_transfer.receiver import KVReceiver
from kv_transfer.security import KVTLSConfig
from kv_transfer.sender import KVTransferClient
from kv_transfer.server import SERVICE, KVTransferServer
from kv_transfer.wire import checksum, frame, tensor_bytes
from protos.gen import kv_transfer_pb2 as pb
from tests.unit.kv_harness import SECRET, Pair, make_pair, wait_for
from tests.unit.pki import write_pki
from tests.unit.tiny import make_engine

CHUNK = (1, 2, 2, 4, 2, 16)  # one layer of two blocks: [layers, 2, blocks, block_size, kv_heads, head_dim]


@pytest.fixture
def pair(tiny_model: LlamaModel) -> Iterator[Pair]:
    p = make_pair(tiny_model, server_kw={"idle_s": 0.5, "max_lease_s": 2.0})
    yield p
    p.close()


def push_all_layers(client: KVTransferClient, rid: str, res: pb.ReserveResponse) -> torch.Tensor:
    data = torch.randn(2, *CHUNK[1:])
    push = client.push(rid, res)
    for layer in range(2):
        push.send(layer, layer + 1, [0, 1], data[layer : layer + 1])
    push.commit(8)
    return data


# ---- Reserve: the cluster secret ------------------------------------------------------------


def test_reserve_needs_the_cluster_secret(pair: Pair) -> None:
    for secret in (None, "wrong", SECRET + "x"):
        client = KVTransferClient(pair.server.endpoint, secret=secret)
        with pytest.raises(ChunkRejected) as err:
            client.reserve("r", 8)
        assert err.value.code == "permission_denied"
        client.close()
    assert len(pair.receiver.table) == 0 and pair.decode.kv.num_free_blocks == 256
    pair.receiver.check_integrity()


def test_a_server_without_a_secret_serves_no_reserve(tiny_model: LlamaModel) -> None:
    receiver = KVReceiver(make_engine(tiny_model, num_blocks=16, role="decode"), threading.RLock())
    server = KVTransferServer(receiver).start()
    client = KVTransferClient(server.endpoint, secret=SECRET)
    try:
        with pytest.raises(ChunkRejected, match="no cluster secret"):
            client.reserve("r", 8)
        receiver.check_integrity()
    finally:
        client.close()
        server.stop(0)


def test_the_lease_a_caller_asks_for_is_capped(pair: Pair) -> None:
    client = pair.client()
    res = client.reserve("r", 8, lease_ms=49 * 24 * 3600 * 1000)
    assert res.lease_ms == 2000
    r = pair.receiver.table.get("r")
    assert r is not None and r.deadline <= pair.receiver.table.clock() + 2.0
    assert pair.receiver.release("r", None, "test done")
    pair.receiver.check_integrity()
    client.close()


# ---- Push and Release: the transfer token --------------------------------------------------


def test_a_wrong_transfer_token_is_refused_everywhere(pair: Pair) -> None:
    client = pair.client()
    res = client.reserve("r", 8)
    forged = pb.ReserveResponse()
    forged.CopyFrom(res)
    forged.transfer_token = "0" * len(res.transfer_token)
    push = client.push("r", forged)
    push.send(0, 1, [0, 1], torch.randn(*CHUNK))
    with pytest.raises(ChunkRejected) as err:
        push.commit(8)
    assert err.value.code == "permission_denied"
    assert not client.release("r", forged.transfer_token, "forged")
    assert not client.release("r", "", "no token")
    assert "r" in pair.receiver.table, "a forged token must not touch the reservation"
    data = push_all_layers(client, "r", res)  # the real token holder is unaffected
    assert torch.equal(pair.decode.cache.read_blocks(list(res.block_ids)), data)
    assert client.release("r", res.transfer_token, "test done")
    assert pair.decode.kv.num_free_blocks == 256
    pair.receiver.check_integrity()
    client.close()


# ---- sizes ----------------------------------------------------------------------------------


def raw_push(endpoint: str, messages: Iterator[bytes]) -> grpc.Future:
    channel = grpc.insecure_channel(endpoint)
    return channel.stream_unary(f"/{SERVICE}/Push")(messages, timeout=10)


def test_an_oversized_message_is_refused_and_the_server_serves_on(pair: Pair) -> None:
    res = pair.receiver.reserve("r", 8)
    big = pb.KVChunkHeader(request_id="r", transfer_token=res.transfer_token, transport="grpc")
    with pytest.raises(grpc.RpcError) as err:
        raw_push(pair.server.endpoint, iter([frame(big, b"\0" * (4 * pair.receiver.max_chunk_bytes))]))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    client = pair.client()
    data = push_all_layers(client, "r", res)
    assert torch.equal(pair.decode.cache.read_blocks(list(res.block_ids)), data)
    assert pair.receiver.release("r", None, "test done")
    pair.receiver.check_integrity()
    client.close()


def test_an_out_of_band_chunk_over_the_limit_is_refused(tiny_model: LlamaModel) -> None:
    receiver = KVReceiver(
        make_engine(tiny_model, num_blocks=16, role="decode"), threading.RLock(), max_chunk_bytes=1024
    )
    res = receiver.reserve("r", 8)
    data = torch.randn(*CHUNK)  # 2 KiB
    h = pb.KVChunkHeader(
        request_id="r", transfer_token=res.transfer_token, layer_start=0, layer_end=1, block_ids=list(res.block_ids),
        dtype="float32", shape=list(CHUNK), payload_bytes=2048, transport="grpc", checksum=checksum(tensor_bytes(data)),
    )  # fmt: skip
    with pytest.raises(ChunkRejected) as err:
        receiver.accept(h, tensor_bytes(data))
    assert err.value.code == "too_large"
    assert "r" not in receiver.table
    receiver.check_integrity()


# ---- stream limits --------------------------------------------------------------------------


class IdleStreams:
    """`n` Push streams that send nothing (or `first`, then nothing) until closed."""

    def __init__(self, endpoint: str, n: int, first: bytes | None = None) -> None:
        self._stop = threading.Event()
        self.channel = grpc.insecure_channel(endpoint)
        call = self.channel.stream_unary(f"/{SERVICE}/Push")
        self.futures = [call.future(self._messages(first)) for _ in range(n)]

    def _messages(self, first: bytes | None) -> Iterator[bytes]:
        if first is not None:
            yield first
        self._stop.wait()

    def close(self) -> None:
        self._stop.set()
        self.channel.close()


def test_idle_streams_block_no_transfer_and_are_cut(tiny_model: LlamaModel) -> None:
    p = make_pair(tiny_model, server_kw={"idle_s": 1.5})
    idle = IdleStreams(p.server.endpoint, 33)
    client = p.client()
    try:
        assert wait_for(lambda: len(p.server.streams) == 33)
        res = client.reserve("real", 8)
        push_all_layers(client, "real", res)
        p.receiver.wait("real", 1.0)
        assert not any(f.done() for f in idle.futures), "the idle streams were cut before the test ran"
        assert client.release("real", res.transfer_token, "test done")
        assert wait_for(lambda: all(f.done() for f in idle.futures), 10)
        assert {f.code() for f in idle.futures} == {grpc.StatusCode.CANCELLED}
        assert wait_for(lambda: len(p.server.streams) == 0)
        assert p.decode.kv.num_free_blocks == 256
        p.receiver.check_integrity()
    finally:
        idle.close()
        client.close()
        p.close()


def test_a_stream_gone_quiet_loses_its_reservation(pair: Pair) -> None:
    client = pair.client()
    res = client.reserve("quiet", 8)
    push = client.push("quiet", res)
    push.send(0, 1, [0, 1], torch.randn(*CHUNK))
    assert wait_for(lambda: "quiet" not in pair.receiver.table, 5)  # cut at idle_s, long before the lease
    with pytest.raises(KVTransferError, match="idle"):
        pair.receiver.wait("quiet", 0.1)
    assert wait_for(lambda: pair.decode.kv.num_free_blocks == 256)
    assert wait_for(lambda: isinstance(push.error, PeerUnavailable))  # the cut reaches the sender too
    pair.receiver.check_integrity()
    client.close()


def test_control_calls_never_wait_behind_push_streams(tiny_model: LlamaModel) -> None:
    p = make_pair(tiny_model, server_kw={"max_streams": 4, "idle_s": 30})
    idle = IdleStreams(p.server.endpoint, 4)
    client = p.client()
    try:
        assert wait_for(lambda: len(p.server.streams) == 4)
        res = client.reserve("r", 8)
        with pytest.raises(KVTransferError, match="Push streams open"):
            push_all_layers(client, "r", res)  # a fifth stream is refused at once, not queued
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(p.server.endpoint))
        t = time.monotonic()
        reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=2)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        res = client.reserve("s", 8)
        assert client.release("s", res.transfer_token, "released")
        assert time.monotonic() - t < 2
        assert wait_for(lambda: p.decode.kv.num_free_blocks == 256)
        p.receiver.check_integrity()
    finally:
        idle.close()
        client.close()
        p.close()


# ---- TLS ------------------------------------------------------------------------------------


def test_tls_round_trip_and_plaintext_is_refused(tiny_model: LlamaModel, tmp_path: Path) -> None:
    server_tls, client_tls = write_pki(tmp_path)
    engine = make_engine(tiny_model, num_blocks=16, role="decode")
    receiver = KVReceiver(engine, threading.RLock())
    server = KVTransferServer(receiver, secret=SECRET, tls=server_tls).start()
    clients = [
        KVTransferClient(server.endpoint, secret=SECRET, tls=client_tls),
        KVTransferClient(server.endpoint, secret=SECRET),  # plaintext
        KVTransferClient(server.endpoint, secret=SECRET, tls=KVTLSConfig(ca_file=client_tls.ca_file)),  # no cert
    ]
    try:
        res = clients[0].reserve("r", 8)
        data = push_all_layers(clients[0], "r", res)
        assert torch.equal(engine.cache.read_blocks(list(res.block_ids)), data)
        assert clients[0].release("r", res.transfer_token, "test done")
        for c in clients[1:]:
            with pytest.raises(PeerUnavailable):
                c.reserve("s", 8)
        assert engine.kv.num_free_blocks == 16
        receiver.check_integrity()
    finally:
        for c in clients:
            c.close()
        server.stop(0)


def test_tls_config_is_checked() -> None:
    with pytest.raises(ValueError, match="together"):
        KVTLSConfig(cert_file="a.pem")
    with pytest.raises(ValueError, match="does not exist"):
        KVTLSConfig(ca_file="/nonexistent/ca.pem")

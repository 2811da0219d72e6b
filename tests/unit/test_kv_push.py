"""The sender never makes the engine wait: stalls, cancels and errors fail one transfer, typed.

Real gRPC on loopback; the one fake is StalledPeer, a KV server that stops reading (the
network boundary). Deadlines are set short here; no test asserts a speed beyond them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence

import grpc
import pytest
import torch

from engine.model import LlamaModel
from engine.sampling_params import SamplingParams
from kv_transfer.errors import KVTransferError, TransferAborted, TransferTimeout
from kv_transfer.payload import InbandWriter
from kv_transfer.push import KVPush
from kv_transfer.sender import KVTransferClient
from kv_transfer.shm_files import SHM_DIR
from kv_transfer.status import as_transfer_error
from tests.unit.kv_harness import Pair, StalledPeer, make_pair, wait_for

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
CHUNK = (1, 2, 2, 4, 2, 16)  # one layer of two blocks: [layers, 2, blocks, block_size, kv_heads, head_dim]
SEND_BOUND_S = 0.05


class TimedPush(KVPush):
    """A KVPush that records its slowest `send` (the engine thread's cost of one layer)."""

    longest = 0.0

    def send(self, layer_start: int, layer_end: int, logical_blocks: Sequence[int], data: torch.Tensor) -> None:
        t = time.perf_counter()
        super().send(layer_start, layer_end, logical_blocks, data)
        self.longest = max(self.longest, time.perf_counter() - t)


@pytest.fixture
def pair(tiny_model: LlamaModel) -> Iterator[Pair]:
    p = make_pair(tiny_model, lease_s=30, max_num_batched_tokens=8)  # several steps per prompt; leases never save us
    yield p
    p.close()


@pytest.fixture
def stalled(pair: Pair) -> Iterator[StalledPeer]:
    peer = StalledPeer(pair.receiver)
    yield peer
    peer.close()


def received(pair: Pair, rid: str) -> bool:
    r = pair.receiver.table.get(rid)
    return r is not None and r.chunks > 0


def start(pair: Pair, pushes: dict[str, KVPush]) -> None:
    """Track each push and queue its prompt (37 tokens, distinct per request) on the prefill engine."""
    for n, (rid, push) in enumerate(pushes.items()):
        pair.streamer.track(rid, push)
        pair.prefill.add_request(rid, list(range(1 + 40 * n, 38 + 40 * n)), PARAMS)


def finish(pair: Pair, rids: list[str]) -> None:
    """Step the prefill engine until every prompt is done (a step must never raise), then hand
    the requests' blocks back."""
    while pair.prefill.has_unfinished():
        pair.prefill.step()
    for rid in rids:
        pair.streamer.untrack(rid)
        pair.prefill.release(rid)
    pair.prefill.check_integrity()


def test_a_stalled_receiver_fails_its_transfer_alone_and_the_engine_never_waits(
    pair: Pair, stalled: StalledPeer
) -> None:
    good_client, stuck_client = pair.client(), KVTransferClient(stalled.endpoint)
    good = TimedPush(good_client, "good", good_client.reserve("good", 37), InbandWriter(), stall_s=0.5)
    stuck = TimedPush(stuck_client, "stuck", stalled.reservation(10), InbandWriter(), stall_s=0.5)
    start(pair, {"good": good, "stuck": stuck})
    finish(pair, ["good", "stuck"])
    assert wait_for(lambda: stalled.pushes == 1)
    assert good.longest < SEND_BOUND_S and stuck.longest < SEND_BOUND_S, (good.longest, stuck.longest)
    stats = good.commit(37)
    assert stats.chunks > 0
    pair.receiver.wait("good", 1.0)
    pair.receiver.check_integrity()
    t = time.monotonic()
    with pytest.raises(TransferTimeout):
        stuck.commit(37)
    assert time.monotonic() - t < 0.5 + 1.0, "the stall deadline was not kept"
    assert isinstance(stuck.error, TransferTimeout)
    assert pair.receiver.release("good", None, "test done")
    assert pair.decode.kv.num_free_blocks == 256 and pair.prefill.kv.num_free_blocks == 256
    good_client.close()
    stuck_client.close()


def test_a_full_queue_fails_the_transfer_at_once(pair: Pair, stalled: StalledPeer) -> None:
    client = KVTransferClient(stalled.endpoint, max_queued_bytes=64 << 10, stall_s=30)
    push = client.push("stuck", stalled.reservation(64))
    data = torch.randn(1, 2, 64, 4, 2, 16)  # 64 KiB a send: the transport's windows fill, then the queue
    longest = 0.0
    for _ in range(400):
        t = time.perf_counter()
        push.send(0, 1, list(range(64)), data)
        longest = max(longest, time.perf_counter() - t)
        if push.error is not None:
            break
    assert isinstance(push.error, TransferTimeout) and "queued" in str(push.error)
    assert longest < SEND_BOUND_S, longest
    with pytest.raises(TransferTimeout):
        push.commit(256)
    client.close()


def test_a_cancelled_push_fails_only_its_own_request(pair: Pair) -> None:
    good_client, doomed_client = pair.client(), pair.client()
    good = good_client.push("good", good_client.reserve("good", 37))
    doomed = doomed_client.push("doomed", doomed_client.reserve("doomed", 37))
    start(pair, {"good": good, "doomed": doomed})
    while doomed.chunks == 0:
        pair.prefill.step()
    assert wait_for(lambda: received(pair, "doomed"))  # its stream is open at both ends
    doomed_client.close()  # cancels the stream under the push: gRPC's cancel, not our abort
    finish(pair, ["good", "doomed"])
    good.commit(37)
    with pytest.raises(KVTransferError):
        doomed.commit(37)
    pair.receiver.wait("good", 1.0)
    assert wait_for(lambda: "doomed" not in pair.receiver.table, 2)  # the server saw the stream go, no lease wait
    assert pair.receiver.release("good", None, "test done")
    assert wait_for(lambda: pair.decode.kv.num_free_blocks == 256)
    pair.receiver.check_integrity()
    pair.prefill.check_integrity()
    good_client.close()


def test_an_abort_mid_prefill_fails_only_that_request(pair: Pair) -> None:
    client = pair.client()
    good = client.push("good", client.reserve("good", 37))
    doomed = client.push("doomed", client.reserve("doomed", 37))
    start(pair, {"good": good, "doomed": doomed})
    pair.prefill.step()
    t = time.monotonic()
    doomed.abort("client went away")
    assert time.monotonic() - t < SEND_BOUND_S, "abort waited on the network"
    finish(pair, ["good", "doomed"])
    good.commit(37)
    with pytest.raises(TransferAborted, match="client went away"):
        doomed.commit(37)
    assert wait_for(lambda: "doomed" not in pair.receiver.table)
    assert pair.receiver.release("good", None, "test done")
    assert wait_for(lambda: pair.decode.kv.num_free_blocks == 256)
    pair.receiver.check_integrity()
    pair.prefill.check_integrity()
    client.close()


def test_a_bad_send_fails_its_transfer_without_raising(pair: Pair) -> None:
    client = pair.client()
    push = client.push("r", client.reserve("r", 8))
    push.send(0, 1, [0, 5], torch.randn(*CHUNK))  # logical block 5 is outside the 2-block reservation
    assert isinstance(push.error, TransferAborted) and "IndexError" in str(push.error)
    push.send(0, 1, [0, 1], torch.randn(*CHUNK))  # a no-op now
    with pytest.raises(TransferAborted):
        push.commit(8)
    assert wait_for(lambda: pair.decode.kv.num_free_blocks == 256)
    pair.receiver.check_integrity()
    client.close()


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (grpc.FutureCancelledError(), TransferAborted),
        (grpc.FutureTimeoutError(), TransferTimeout),
        (OSError(28, "No space left on device"), TransferAborted),
        (RuntimeError("anything"), TransferAborted),
    ],
)
def test_every_transport_exception_becomes_a_typed_error(exc: Exception, kind: type[KVTransferError]) -> None:
    err = as_transfer_error(exc, "push 'r'")
    assert type(err) is kind and "push 'r'" in str(err)


def test_lease_renews_while_chunks_keep_coming(tiny_model: LlamaModel) -> None:
    p = make_pair(tiny_model, lease_s=0.4)
    client = p.client()
    try:
        res = client.reserve("slow", 8)
        push = client.push("slow", res)
        start = time.monotonic()
        while time.monotonic() - start < 3 * 0.4:  # a slow prefill: a chunk every 0.1 s, past the lease
            push.send(0, 1, [0, 1], torch.randn(*CHUNK))
            assert "slow" in p.receiver.table
            time.sleep(0.1)
        push.send(1, 2, [0, 1], torch.randn(*CHUNK))
        push.commit(8)
        p.receiver.wait("slow", 1.0)
        p.receiver.check_integrity()
        assert p.receiver.release("slow", None, "test done")
        assert p.decode.kv.num_free_blocks == 256
    finally:
        client.close()
        p.close()


def test_a_send_over_the_chunk_limit_goes_as_several_chunks(tiny_model: LlamaModel) -> None:
    p = make_pair(tiny_model, max_chunk_bytes=2048)  # two blocks of one layer (1 KiB each)
    client = p.client()
    try:
        res = client.reserve("big", 40)
        assert res.max_chunk_bytes == 2048
        data = torch.randn(2, 2, 10, 4, 2, 16)  # both layers of 10 blocks: 20 KiB
        push = client.push("big", res)
        push.send(0, 2, list(range(10)), data)
        stats = push.commit(40)
        assert stats.chunks == 2 * 5 and stats.bytes == data.numel() * 4
        assert torch.equal(p.decode.cache.read_blocks(list(res.block_ids)), data)
        p.receiver.check_integrity()
        assert p.receiver.release("big", None, "test done")
    finally:
        client.close()
        p.close()


def shm_files() -> set[str]:
    """This process's shm segments in /dev/shm (kv_transfer/payload.py names them by pid).

    Tests compare what a test created (after - before): a pool an earlier test dropped may be unlinked by the
    garbage collector at any point, so segments can also vanish while a test runs."""
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"tandem-kv-{os.getpid()}-")}


@pytest.mark.parametrize("transport", ["grpc", "shm"])
@pytest.mark.parametrize("max_chunk_bytes", [None, 2048])
def test_send_blocks_gathers_the_blocks_itself_bit_identical(
    tiny_model: LlamaModel, transport: str, max_chunk_bytes: int | None
) -> None:
    p = make_pair(tiny_model, max_chunk_bytes=max_chunk_bytes)  # 2048: two blocks of one layer a chunk
    before = shm_files()
    client = p.client(transport)
    try:
        kv = p.prefill.cache.kv  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        kv.copy_(torch.randn(kv.shape))
        src = torch.tensor([7, 3, 250, 0, 42])
        res = client.reserve("r", 20)
        push = client.push("r", res)
        push.send_blocks(0, 1, range(5), kv[0:1], src)
        push.send_blocks(1, 2, range(5), kv[1:2], src)
        stats = push.commit(20)
        assert stats.bytes == 2 * 2 * 5 * 4 * 2 * 16 * 4
        assert stats.chunks == (2 if max_chunk_bytes is None else 2 * 3)
        assert torch.equal(p.decode.cache.read_blocks(list(res.block_ids)), kv.index_select(2, src))
        p.receiver.check_integrity()
        assert p.receiver.release("r", None, "test done")
    finally:
        client.close()
        p.close()
    assert shm_files() - before == set(), "the client's shm segments outlived it"


def test_send_blocks_with_a_bad_source_fails_its_transfer_without_raising(pair: Pair) -> None:
    client = pair.client("shm")
    push = client.push("r", client.reserve("r", 8))
    kv = pair.prefill.cache.kv
    push.send_blocks(0, 1, [0, 1], kv[0:1], torch.tensor([3]))  # two logical blocks, one source block
    assert isinstance(push.error, TransferAborted) and "ValueError" in str(push.error)
    push.send_blocks(0, 1, [0, 1], kv[0:1], torch.tensor([3, 4]))  # a no-op now
    with pytest.raises(TransferAborted):
        push.commit(8)
    assert wait_for(lambda: pair.decode.kv.num_free_blocks == 256)
    pair.receiver.check_integrity()
    client.close()


def test_shm_pushes_reuse_their_segments_and_leave_none_behind(pair: Pair) -> None:
    before = shm_files()
    client = pair.client("shm")
    data = torch.randn(*CHUNK)
    seen: set[str] = set()
    for n in range(4):
        push = client.push(f"r{n}", client.reserve(f"r{n}", 8))
        push.send(0, 1, [0, 1], data)
        push.send(1, 2, [0, 1], data)
        push.commit(8)
        assert pair.receiver.release(f"r{n}", None, "test done")
        seen |= shm_files() - before
    assert len(seen) == 1, "each push took a new segment"
    client.close()
    assert shm_files() - before == set()
    assert pair.decode.kv.num_free_blocks == 256

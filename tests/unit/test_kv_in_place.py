"""Same-host transfers written straight into the receiver's cache, and the fence that keeps a
sender's late writes out of blocks another request could be given.

Real gRPC on loopback, a receiver whose cache lives in /dev/shm, real processes killed for
the holder lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from engine.model import LlamaModel
from engine.paged_cache import PagedKVCache
from kv_transfer.chunk_writer import HOLD_S, InPlaceHeaders
from kv_transfer.errors import ChunkRejected, KVTransferError
from kv_transfer.in_place import SharedCache
from kv_transfer.in_place_writer import CACHES, InPlaceWriter, copy_blocks
from kv_transfer.payload import InbandWriter, ShmWriter
from kv_transfer.selection import Placement, here, select
from kv_transfer.sender import KVTransferClient
from kv_transfer.shm_files import CACHE_PREFIX, HOLDER_PREFIX, SHM_DIR, held
from kv_transfer.wire import frame
from protos.gen import kv_transfer_pb2 as pb
from tests.unit.kv_harness import Pair, make_pair, wait_for
from tests.unit.tiny import TINY

NUM_BLOCKS = 256
SHARED_CACHE_CHILD = """
import sys, time, torch
from engine.paged_cache import PagedKVCache
from kv_transfer.in_place import SharedCache
from tests.unit.tiny import TINY
shared = SharedCache.share(PagedKVCache(TINY, 8, 4, torch.float32))
print(shared.name, flush=True)
time.sleep(600)
"""


@pytest.fixture
def pair(tiny_model: LlamaModel) -> Iterator[Pair]:
    p = make_pair(tiny_model, lease_s=30, in_place=True)
    yield p
    p.close()


def ours() -> set[str]:
    return {f for f in os.listdir(SHM_DIR) if f.startswith(("tandem-kv", "."))}


def claimed_push(client: KVTransferClient, rid: str, tokens: int) -> tuple[pb.ReserveResponse, InPlaceWriter]:
    res = client.reserve(rid, tokens)
    push = client.push(rid, res)
    writer = push.writer
    assert isinstance(writer, InPlaceWriter), "a shm push into a shared cache writes in place"
    assert wait_for(lambda: writer.claimed)
    return res, writer


@pytest.mark.parametrize("src", [[0, 1, 2, 3, 4], [7, 3, 250, 0, 42]], ids=["runs", "scattered"])
@pytest.mark.parametrize("max_chunk_bytes", [None, 2048])
def test_an_in_place_push_lands_bit_identical_with_no_payload_copied(
    tiny_model: LlamaModel, src: list[int], max_chunk_bytes: int | None
) -> None:
    p = make_pair(tiny_model, max_chunk_bytes=max_chunk_bytes, in_place=True)
    client = p.client("shm")
    before = ours()
    try:
        kv = p.prefill.cache.kv
        kv.copy_(torch.randn(kv.shape))
        res = client.reserve("r", 20)
        push = client.push("r", res)
        assert isinstance(push.writer, InPlaceWriter)
        assert wait_for(lambda: isinstance(push.writer, InPlaceWriter) and push.writer.claimed)
        for layer in range(kv.shape[0]):
            push.send_blocks(layer, layer + 1, range(5), kv[layer : layer + 1], torch.tensor(src))
        stats = push.commit(20)
        assert stats.bytes == kv.shape[0] * 2 * 5 * 4 * 2 * 16 * 4
        assert torch.equal(p.decode.cache.read_blocks(list(res.block_ids)), kv.index_select(2, torch.tensor(src)))
        assert not {f for f in ours() - before if f.startswith("tandem-kv-")}, "a payload went through a segment"
        p.receiver.check_integrity()
        assert p.receiver.release("r", None, "test done")
        p.receiver.check_integrity()
    finally:
        client.close()
        p.close()


def test_sends_before_the_claim_is_answered_go_through_segments_and_still_land(pair: Pair) -> None:
    client = pair.client("shm")
    res = client.reserve("r", 8)
    push = client.push("r", res)
    data = torch.randn(1, 2, 2, 4, 2, 16)
    push.send(0, 1, [0, 1], data)  # most likely before the claim's answer: through a segment
    assert isinstance(push.writer, InPlaceWriter)
    assert wait_for(lambda: isinstance(push.writer, InPlaceWriter) and push.writer.claimed)
    push.send(1, 2, [0, 1], data)  # in place
    push.commit(8)
    got = pair.decode.cache.read_blocks(list(res.block_ids[:2]), slice(0, 2))
    assert torch.equal(got, torch.cat([data, data]))
    assert pair.receiver.release("r", None, "test done")
    pair.receiver.check_integrity()
    client.close()


def test_a_claimed_reservation_the_owner_drops_stays_fenced_until_the_sender_lets_go(pair: Pair) -> None:
    client = pair.client("shm")
    res, _ = claimed_push(client, "r", 8)
    taken = NUM_BLOCKS - pair.decode.kv.num_free_blocks
    assert taken == 2
    assert pair.receiver.release("r", None, "the client went away")  # the decode side's own abort
    assert "r" in pair.receiver.fence
    assert pair.decode.kv.num_free_blocks == NUM_BLOCKS - 2, "fenced blocks went back while the sender may write"
    pair.receiver.check_integrity()
    assert not pair.receiver.release("r", "not-the-token", "a stranger")
    assert client.release("r", res.transfer_token, "the sender stopped")  # what KVPush does after closing its writer
    assert pair.decode.kv.num_free_blocks == NUM_BLOCKS
    pair.receiver.check_integrity()
    client.close()


def test_a_failed_in_place_push_frees_its_fenced_blocks_itself(pair: Pair) -> None:
    client = pair.client("shm")
    res = client.reserve("r", 8)
    push = client.push("r", res)
    assert wait_for(lambda: isinstance(push.writer, InPlaceWriter) and push.writer.claimed)
    push.send(0, 1, [0, 1], torch.randn(1, 2, 2, 4, 2, 16))
    assert pair.receiver.expire() == [] and pair.receiver.release("r", None, "lease ran out")
    assert "r" in pair.receiver.fence
    push.abort("prefill aborted")  # closes its writer, then Releases
    assert wait_for(lambda: pair.decode.kv.num_free_blocks == NUM_BLOCKS)
    assert "r" not in pair.receiver.fence
    pair.receiver.check_integrity()
    client.close()


def test_fenced_blocks_are_freed_when_the_senders_process_is_killed(pair: Pair) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from kv_transfer.in_place import holder; print(holder()); "
         "sys.stdout.flush(); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        name = child.stdout.readline().strip()
        assert name.startswith(HOLDER_PREFIX) and held(name)
        res = pair.receiver.reserve("r", 8)
        pair.receiver.claim("r", res.transfer_token, name)
        assert pair.receiver.release("r", None, "the client went away")
        pair.receiver.expire()
        assert "r" in pair.receiver.fence, "the sender lives: its blocks stay fenced"
        pair.receiver.check_integrity()
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert not held(name)
        pair.receiver.expire()  # the reaper's round
        assert "r" not in pair.receiver.fence
        assert pair.decode.kv.num_free_blocks == NUM_BLOCKS
        pair.receiver.check_integrity()
        SharedCache.share(pair.prefill.cache)  # any new shared file sweeps what the dead left
        assert name not in os.listdir(SHM_DIR)
    finally:
        child.kill()
        child.wait()


def test_an_in_place_chunk_without_a_claim_is_rejected_and_frees_the_blocks(pair: Pair) -> None:
    client = pair.client("grpc")
    res = client.reserve("r", 8)
    push = client.push("r", res)
    header = pb.KVChunkHeader(
        request_id="r", transfer_token=res.transfer_token, layer_start=0, layer_end=1, block_ids=res.block_ids[:2],
        dtype="float32", shape=[1, 2, 2, 4, 2, 16], payload_bytes=2 * 2 * 4 * 2 * 16 * 4, transport="in_place",
    )  # fmt: skip
    push.send_frame(frame(header))
    with pytest.raises(KVTransferError, match="without a claim"):
        push.commit(8)
    assert wait_for(lambda: pair.decode.kv.num_free_blocks == NUM_BLOCKS)
    assert "r" not in pair.receiver.fence
    pair.receiver.check_integrity()
    client.close()


def test_a_claim_is_refused_without_a_shared_cache_or_a_good_holder(tiny_model: LlamaModel, pair: Pair) -> None:
    private = make_pair(tiny_model)
    try:
        res = private.receiver.reserve("r", 8)
        assert not res.cache_shm_name
        client = private.client("shm")
        assert isinstance(client.push("r", res).writer, ShmWriter), "no shared cache: through segments"
        client.close()
        with pytest.raises(ChunkRejected, match="not shared"):
            private.receiver.claim("r", res.transfer_token, f"{HOLDER_PREFIX}x")
    finally:
        private.close()
    res = pair.receiver.reserve("q", 8)
    assert res.cache_shm_name.startswith(CACHE_PREFIX)
    for bad in ("../etc/passwd", f"{CACHE_PREFIX}x"):
        with pytest.raises(ChunkRejected):
            pair.receiver.claim("q", res.transfer_token, bad)
    with pytest.raises(ChunkRejected, match="wrong"):
        pair.receiver.claim("q", "t" * 32, f"{HOLDER_PREFIX}x")
    pair.receiver.claim("q", res.transfer_token, f"{HOLDER_PREFIX}x")
    with pytest.raises(ChunkRejected, match="claimed by"):
        pair.receiver.claim("q", res.transfer_token, f"{HOLDER_PREFIX}y")


@pytest.mark.parametrize(
    "src,dst",
    [
        (list(range(10)), list(range(20, 30))),  # one run
        ([4, 5, 6, 7, 0, 1, 2, 3], [8, 9, 10, 11, 12, 13, 14, 15]),  # two runs
        ([9, 2, 17, 4, 11, 0], [3, 30, 1, 22, 7, 15]),  # scattered
    ],
)
def test_copy_blocks_matches_an_indexed_assignment(src: list[int], dst: list[int]) -> None:
    a = torch.randn(3, 2, 32, 4, 2, 8)
    got, want = torch.zeros_like(a), torch.zeros_like(a)
    copy_blocks(got, dst, a, torch.tensor(src))
    want[:, :, dst] = a[:, :, src]
    assert torch.equal(got, want)
    got.zero_()
    copy_blocks(got, dst, a[:, :, src].contiguous(), None)  # a chunk already gathered
    assert torch.equal(got, want)
    with pytest.raises(ValueError):
        copy_blocks(got, dst[:-1], a, torch.tensor(src))


def test_the_shared_cache_file_goes_with_its_receiver(tiny_model: LlamaModel) -> None:
    p = make_pair(tiny_model, in_place=True)
    shared = p.receiver.shared
    assert shared is not None
    path = os.path.join(SHM_DIR, shared.name)
    assert os.path.exists(path)
    p.close()
    shared.close()
    assert not os.path.exists(path)


def test_a_dead_receivers_cache_is_unmapped_by_the_next_mapping_and_swept(pair: Pair) -> None:
    child = subprocess.Popen([sys.executable, "-c", SHARED_CACHE_CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        name = child.stdout.readline().strip()
        layout = pair.receiver.layout
        theirs = pb.ReserveResponse(cache_shm_name=name, cache_num_blocks=8, layout=layout)
        assert CACHES.get(theirs) is not None and name in CACHES.names()
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        ours = pair.receiver.reserve("r", 4)
        assert CACHES.get(ours) is not None
        assert name not in CACHES.names(), "a dead receiver's cache stayed mapped"
        SharedCache.share(pair.prefill.cache)
        assert name not in os.listdir(SHM_DIR), "nor did its file stay in /dev/shm"
    finally:
        child.kill()
        child.wait()


def test_kv_of_another_dtype_fails_the_push_before_a_byte_lands(pair: Pair) -> None:
    client = pair.client("shm")
    res, writer = claimed_push(client, "r", 8)
    before = pair.decode.cache.kv.clone()
    with pytest.raises(ValueError, match="bfloat16"):
        writer.write(pb.KVChunkHeader(layer_start=0, layer_end=1, block_ids=[0, 1]), torch.zeros(1, 2, 2, 4, 2, 16,
                     dtype=torch.bfloat16), None)  # fmt: skip
    assert torch.equal(pair.decode.cache.kv, before)
    assert client.release("r", res.transfer_token, "the sender gives up")
    assert pair.decode.kv.num_free_blocks == NUM_BLOCKS
    pair.receiver.check_integrity()
    client.close()


def test_in_place_headers_that_continue_each_other_go_as_one() -> None:
    now = [0.0]
    held = InPlaceHeaders(lambda: now[0])

    def layer(i: int, blocks: list[int]) -> pb.KVChunkHeader:
        return pb.KVChunkHeader(layer_start=i, layer_end=i + 1, block_ids=blocks, shape=[1, 2, len(blocks)],
                                payload_bytes=100 * len(blocks))  # fmt: skip

    assert held.add(layer(0, [3, 4])) == [] and held.add(layer(1, [3, 4])) == []
    now[0] = HOLD_S + 0.01
    (merged,) = held.add(layer(2, [3, 4]))  # held too long: out it goes, liveness first
    assert (merged.layer_start, merged.layer_end, merged.shape[0], merged.payload_bytes) == (0, 3, 3, 600)
    assert held.add(layer(3, [3, 4])) == []
    (out,) = held.add(layer(0, [5]))  # another chunk's blocks: the held one goes first
    assert (out.layer_start, out.layer_end) == (3, 4)
    (last,) = held.flush()
    assert list(last.block_ids) == [5] and held.flush() == []


def test_transport_selection_is_a_function_of_placement() -> None:
    cpu_a, cpu_b = Placement("a"), Placement("b")
    assert select(cpu_a, Placement("a")) == "shm" and select(cpu_a, cpu_b) == "grpc"
    assert select(Placement(""), Placement("")) == "grpc", "an unknown host is never the same host"
    g0, g1, far = Placement("a", "GPU-0"), Placement("a", "GPU-1"), Placement("b", "GPU-2")
    every = ("grpc", "shm", "cuda-ipc", "nccl")
    assert select(g0, Placement("a", "GPU-0"), every) == "cuda-ipc"
    assert select(g0, g1, every) == "cuda-ipc" and select(g0, g1, ("grpc", "nccl")) == "nccl"
    assert select(g0, far, every) == "nccl"
    assert select(g0, g1) == "grpc", "GPU caches never go through host shm; until issue 16, grpc"


def test_auto_goes_in_place_where_the_cache_is_reachable_and_over_grpc_elsewhere(
    tiny_model: LlamaModel, pair: Pair
) -> None:
    client = pair.client("auto")
    res = pair.receiver.reserve("near", 8)
    assert res.node == here().node
    assert isinstance(client.push("near", res).writer, InPlaceWriter)
    far = pb.ReserveResponse()
    far.CopyFrom(res)
    far.node = "another-host"
    assert isinstance(client.push("near", far).writer, InbandWriter)
    private = make_pair(tiny_model)  # same host name, but its cache is not in /dev/shm
    try:
        mine = private.receiver.reserve("r", 8)
        assert isinstance(private.client("auto").push("r", mine).writer, InbandWriter)
    finally:
        private.close()
    client.close()


def test_a_cache_whose_contents_do_not_matter_moves_to_shared_memory_without_a_copy() -> None:
    for contents in (True, False):
        cache = PagedKVCache(TINY, 8, 4, torch.float32)
        cache.kv.fill_(1.0)
        private = cache.kv.data_ptr()
        shared = SharedCache.share(cache, contents)
        assert shared is not None
        try:
            assert cache.kv.data_ptr() != private and cache.k_flat[0].data_ptr() == cache.kv.data_ptr()
            assert float(cache.kv.mean()) == (1.0 if contents else 0.0), "copied, or the segment's zeros"
        finally:
            shared.close()

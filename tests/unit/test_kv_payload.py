"""Payload layout and the shm transport's pieces, without a network: chunking, the gather, the
receiver's write into the paged cache, and shared-memory segments' lifecycle (nothing left in
/dev/shm, nothing unmapped under a writer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from engine.model import LlamaModel
from engine.paged_cache import PagedKVCache
from kv_transfer.errors import ChunkRejected
from kv_transfer.payload import ShmReader, ShmSegmentPool, ShmWriter
from kv_transfer.receiver import KVReceiver
from kv_transfer.shm_files import SHM_DIR, sweep
from kv_transfer.wire import checksum, chunk_spans, gather, split, tensor_bytes
from protos.gen import kv_transfer_pb2 as pb
from tests.unit.tiny import TINY, make_engine


def segment_files(names: list[str]) -> list[str]:
    return [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]


# ---- chunking and the gather ---------------------------------------------------------------


def test_chunks_are_whole_layers_while_one_fits_else_runs_of_blocks() -> None:
    every = (slice(0, 3), slice(0, 4))
    assert list(chunk_spans(3, 4, 100, 0)) == [every]
    assert list(chunk_spans(3, 4, 100, 1200)) == [every]
    assert list(chunk_spans(3, 4, 100, 800)) == [(slice(0, 2), slice(0, 4)), (slice(2, 3), slice(0, 4))]
    assert list(chunk_spans(3, 4, 100, 250)) == [
        (slice(layer, layer + 1), blocks) for layer in range(3) for blocks in (slice(0, 2), slice(2, 4))
    ]
    with pytest.raises(ValueError, match="one layer of one block is 100 bytes"):
        list(chunk_spans(3, 4, 100, 99))


def test_split_cuts_data_as_the_spans_say() -> None:
    data = torch.randn(3, 2, 4, 4, 2, 16)  # one layer of one block: 2 * 4 * 2 * 16 * 4 = 1 KiB
    got = list(split(data, [10, 11, 12, 13], 2048))
    assert [(lo, blocks) for lo, blocks, _ in got] == [(layer, b) for layer in range(3) for b in ([10, 11], [12, 13])]
    for k, (lo, _, part) in enumerate(got):
        assert part.is_contiguous() and torch.equal(part, data[lo : lo + 1, :, 2 * (k % 2) : 2 * (k % 2) + 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_is_index_select_on_the_block_dimension(dtype: torch.dtype) -> None:
    kv = torch.randn(3, 2, 7, 4, 2, 16).to(dtype)  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    src = torch.tensor([5, 0, 3, 6])
    want = kv.index_select(2, src)
    assert torch.equal(gather(kv, src), want)
    out = torch.empty_like(want)
    assert gather(kv, src, out) is out and torch.equal(out, want)
    wide = torch.randn(3, 2, 7, 4, 2, 32).to(dtype)
    strided = wide[..., :16]  # not contiguous: the plain index_select path
    assert torch.equal(gather(strided, src), strided.index_select(2, src))


# ---- the receiver's write ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_blocks_writes_those_blocks_of_those_layers_only(dtype: torch.dtype) -> None:
    cache = PagedKVCache(TINY, 8, 4, dtype)
    cache.kv.copy_(torch.randn(cache.kv.shape))
    want = cache.kv.clone()
    data = torch.randn(1, 2, 3, *cache.block_shape).to(dtype)
    cache.write_blocks([6, 1, 3], data, slice(1, 2))
    want[1:2].index_copy_(2, torch.tensor([6, 1, 3]), data)
    assert torch.equal(cache.kv, want)
    cache.write_blocks([], torch.empty(2, 2, 0, *cache.block_shape, dtype=dtype))
    assert torch.equal(cache.kv, want)


def test_write_blocks_refuses_what_does_not_fit_and_writes_nothing() -> None:
    cache = PagedKVCache(TINY, 8, 4, torch.float32)
    data = torch.randn(2, 2, 2, *cache.block_shape)
    for bad in ([0, 8], [-1, 0]):
        with pytest.raises(IndexError, match="outside"):
            cache.write_blocks(bad, data)
    with pytest.raises(ValueError, match="does not match"):
        cache.write_blocks([0, 1], data, slice(0, 1))
    with pytest.raises(ValueError, match="does not match"):
        cache.write_blocks([0, 1], data.to(torch.bfloat16))
    assert not cache.kv.any()


# ---- shm segments --------------------------------------------------------------------------


def test_segments_are_reused_across_writers_and_gone_from_dev_shm_on_close() -> None:
    pool = ShmSegmentPool(1 << 20)
    data = torch.randn(1, 2, 64, 4, 2, 16)  # 64 KiB
    first = ShmWriter(pool)
    for _ in range(20):  # 1.25 MiB: a second segment
        first.put(pb.KVChunkHeader(), data)
    first.close()
    names = pool.names()
    assert len(names) == 2 and segment_files(names) == names
    again = ShmWriter(pool)
    for _ in range(20):
        again.put(pb.KVChunkHeader(), data)
    again.close()
    assert sorted(pool.names()) == sorted(names)
    pool.close()
    assert pool.names() == [] and segment_files(names) == []
    with pytest.raises(RuntimeError, match="closed"):
        ShmWriter(pool).put(pb.KVChunkHeader(), data)
    assert pool.names() == []


def test_a_segment_lent_when_the_pool_closes_stays_mapped_until_given_back() -> None:
    pool = ShmSegmentPool(1 << 20)
    writer = ShmWriter(pool)
    h = pb.KVChunkHeader()
    view = writer.claim(h, (1, 2, 4, 4, 2, 16), torch.float32)
    (name,) = pool.names()
    pool.close()
    assert segment_files([name]) == []  # unlinked at once
    view.fill_(1.0)  # still mapped: the writer has not given it back
    writer.close()  # unmapped now; nothing to check but that it did not raise


def test_what_the_writer_claims_is_what_the_reader_maps() -> None:
    pool = ShmSegmentPool(1 << 20)
    writer, reader = ShmWriter(pool), ShmReader()
    src = torch.randn(2, 2, 3, 4, 2, 16)
    headers = []
    for _ in range(3):
        h = pb.KVChunkHeader(payload_bytes=src.numel() * 4)
        torch.index_select(src, 2, torch.tensor([2, 0, 1]), out=writer.claim(h, tuple(src.shape), src.dtype))
        headers.append(h)
    want = tensor_bytes(src.index_select(2, torch.tensor([2, 0, 1])))
    for h in headers:
        got = reader.get(h, memoryview(b""))
        assert h.transport == "shm" and bytes(got) == bytes(want) and checksum(got) == checksum(want)
        del got
    reader.close()
    writer.close()
    pool.close()


def test_a_shm_payload_changed_after_its_checksum_is_rejected_and_writes_nothing(tiny_model: LlamaModel) -> None:
    decode = make_engine(tiny_model, num_blocks=16, role="decode")
    receiver = KVReceiver(decode, threading.RLock())
    res = receiver.reserve("r", 8)
    pool = ShmSegmentPool(1 << 20)
    writer = ShmWriter(pool)
    data = torch.randn(1, 2, 2, 4, 2, 16)
    h = pb.KVChunkHeader(
        request_id="r",
        transfer_token=res.transfer_token,
        layer_start=0,
        layer_end=1,
        block_ids=list(res.block_ids),
        dtype="float32",
        shape=list(data.shape),
        payload_bytes=data.numel() * 4,
        checksum=checksum(tensor_bytes(data)),
    )
    try:
        writer.put(h, data)
        fd = os.open(os.path.join(SHM_DIR, h.shm_name), os.O_RDWR)
        try:  # the sender's memory changed after it checksummed: flip every bit of one byte, whatever it held
            byte = os.pread(fd, 1, h.shm_offset + 100)
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), h.shm_offset + 100)
        finally:
            os.close(fd)
        with pytest.raises(ChunkRejected) as err:
            receiver.accept(h, memoryview(b""))
        assert err.value.code == "bad_checksum"
        assert not decode.cache.kv.any()
        assert "r" not in receiver.table
        receiver.check_integrity()
    finally:
        receiver.readers["shm"].close()
        writer.close()
        pool.close()


def test_a_process_that_dies_of_an_exception_leaves_no_segment_behind() -> None:
    code = (
        "import os, sys\n"
        "from kv_transfer.payload import ShmSegmentPool\n"
        "pool = ShmSegmentPool(1 << 20)\n"
        "name, _ = pool.acquire(1)\n"
        "print(name, flush=True)\n"
        "raise SystemExit('dies without closing its pool')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout.startswith("tandem-kv-"), done.stderr
    assert segment_files([done.stdout.strip()]) == []


def test_a_killed_senders_segments_are_swept_and_a_live_ones_are_not() -> None:
    """SIGKILL runs no exit hook: its segments stayed in /dev/shm (memory) until a reboot."""
    code = (
        "import time\n"
        "from kv_transfer.payload import ShmSegmentPool\n"
        "pool = ShmSegmentPool(1 << 20)\n"
        "name, buf = pool.acquire(1)\n"
        "buf[:4] = b'kept'\n"
        "print(name, flush=True)\n"
        "time.sleep(600)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE, text=True)
    pool = ShmSegmentPool(1 << 20)
    try:
        assert child.stdout is not None
        theirs = child.stdout.readline().strip()
        ours, _ = pool.acquire(1)
        sweep()
        assert segment_files([theirs, ours]) == [theirs, ours], "both makers live"
        header = pb.KVChunkHeader(shm_name=theirs, shm_offset=0, payload_bytes=4)
        assert bytes(ShmReader().get(header, memoryview(b""))) == b"kept"
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        sweep()
        assert segment_files([theirs, ours]) == [ours]
    finally:
        child.kill()
        child.wait()
        pool.close()
    assert segment_files([ours]) == []

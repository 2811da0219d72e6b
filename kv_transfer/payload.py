"""How payload bytes travel. Control (headers, commit, errors) always goes over gRPC.

    grpc  in the Push message itself, after the header (cross-host default)
    shm   in a /dev/shm file the sender writes and the receiver maps (same host)

A transport is a writer on the sender (`put` fills the header's location fields and
returns the in-band bytes, empty when out of band) and a reader on the receiver (`get`
returns the payload bytes the header points at). The collective transport lives in
kv_transfer/collective.py.

On shm each side copies a payload once; nothing else touches its bytes but the checksum:

    sender    paged cache ──gather (wire.gather, out=)──▶ segment (ShmWriter.claim)
    receiver  segment, mapped read-only (ShmReader.get) ──write_blocks──▶ paged cache
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from typing import Protocol

import torch

from kv_transfer.shm_files import SEGMENT_PREFIX, SHM_DIR, create_locked, shm_path, unlink
from kv_transfer.wire import tensor_bytes
from protos.gen import kv_transfer_pb2 as pb


class PayloadWriter(Protocol):
    def put(self, header: pb.KVChunkHeader, data: torch.Tensor) -> memoryview: ...
    def settle(self) -> None:
        """Called once the receiver has acknowledged every payload (after a commit)."""

    def close(self) -> None: ...


class PayloadReader(Protocol):
    def get(self, header: pb.KVChunkHeader, inband: memoryview) -> memoryview: ...
    def close(self) -> None: ...


class InbandWriter:
    def put(self, header: pb.KVChunkHeader, data: torch.Tensor) -> memoryview:
        header.transport = "grpc"
        return tensor_bytes(data)

    def settle(self) -> None:
        pass

    def close(self) -> None:
        pass


class InbandReader:
    def get(self, header: pb.KVChunkHeader, inband: memoryview) -> memoryview:
        return inband

    def close(self) -> None:
        pass


class ShmSegmentPool:
    """Sender-owned /dev/shm segments, reused across transfers: a fresh segment costs a page
    fault per 4 KiB on first write (~10x the copy itself). A segment is lent to one push at a
    time and given back after its commit was answered (the receiver has read it all).

    `close` unlinks every segment; so does the interpreter's exit (or the pool's collection)
    if `close` never ran, so a process that dies of an exception leaves nothing in /dev/shm,
    and the next sweep those of a killed one (kv_transfer/shm_files.py: each is locked)."""

    def __init__(self, segment_bytes: int = 64 << 20) -> None:
        self.segment_bytes = max(segment_bytes, 1 << 20)
        self._free: list[tuple[str, mmap.mmap]] = []
        self._names: set[str] = set()  # every segment made and not yet unlinked
        self._fds: list[int] = []  # each segment's lock, held until close
        self._lock = threading.Lock()
        self._closed = False
        weakref.finalize(self, _unlink, self._names, self._fds)

    def acquire(self, need: int) -> tuple[str, mmap.mmap]:
        """A segment of at least `need` bytes. Raises RuntimeError once the pool is closed,
        OSError if /dev/shm is full."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the shm segment pool is closed")
            for k, (_, buf) in enumerate(self._free):
                if len(buf) >= need:
                    return self._free.pop(k)
        size = max(self.segment_bytes, need)
        name, fd = create_locked(SEGMENT_PREFIX, 0)
        try:
            os.ftruncate(fd, size)  # sparse: pages come as they are written
            buf = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            _unlink({name}, [])
            raise
        with self._lock:
            if not self._closed:
                self._names.add(name)
                self._fds.append(fd)
                return name, buf
        buf.close()  # the pool closed while it was made
        os.close(fd)
        _unlink({name}, [])
        raise RuntimeError("the shm segment pool is closed")

    def release(self, segments: list[tuple[str, mmap.mmap]]) -> None:
        with self._lock:
            if not self._closed:
                self._free.extend(segments)
                return
        for _, buf in segments:  # lent out when the pool closed: unlinked then, unmapped now
            buf.close()

    def close(self) -> None:
        """Unlink every segment (the client is done) and unmap those not lent out; a lent one is
        unmapped when its push gives it back, so no writer ever copies into unmapped memory."""
        with self._lock:
            self._closed = True
            _unlink(self._names, self._fds)
            for _, buf in self._free:
                buf.close()
            self._free.clear()

    def names(self) -> list[str]:
        """The segments this pool holds in /dev/shm."""
        with self._lock:
            return sorted(self._names)


def _unlink(names: set[str], fds: list[int]) -> None:
    for name in names:
        unlink(shm_path(name, SEGMENT_PREFIX))
    names.clear()
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


class ShmWriter:
    """Writes one push's payloads into segments borrowed from a pool (bump allocation; another
    segment when one fills); gives them back on close. Not thread-safe: KVPush serialises
    `claim`/`put` and `close`, and uses a claimed view only until it closes the writer."""

    def __init__(self, pool: ShmSegmentPool) -> None:
        self.pool = pool
        self._segments: list[tuple[str, mmap.mmap]] = []
        self._offset = 0

    def claim(self, header: pb.KVChunkHeader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` over the next free bytes of shared memory, for the caller to fill
        (a gather's `out=`); fills the header's location fields. Raises RuntimeError if the pool
        is closed, OSError if /dev/shm is full."""
        count = torch.Size(shape).numel()
        n = count * dtype.itemsize
        if not self._segments or self._offset + n > len(self._segments[-1][1]):
            self._segments.append(self.pool.acquire(n))
            self._offset = 0
        name, buf = self._segments[-1]
        dst = torch.frombuffer(buf, dtype=dtype, count=count, offset=self._offset).view(shape)
        header.transport, header.shm_name, header.shm_offset = "shm", name, self._offset
        self._offset += n
        return dst

    def put(self, header: pb.KVChunkHeader, data: torch.Tensor) -> memoryview:
        self.claim(header, tuple(data.shape), data.dtype).copy_(data)
        return memoryview(b"")

    def settle(self) -> None:
        pass

    def close(self) -> None:
        self.pool.release(self._segments)
        self._segments = []


class ShmReader:
    """Maps a sender's segments on first sight and keeps the most recent `keep` mappings
    (segments are reused across transfers; an unlinked one is freed when its mapping goes)."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()

    def get(self, header: pb.KVChunkHeader, inband: memoryview) -> memoryview:
        name = header.shm_name
        if "/" in name or not name.startswith(SEGMENT_PREFIX):
            raise ValueError(f"bad shm segment name {name!r}")
        buf = self._maps.get(name)
        if buf is None:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
            try:
                buf = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self._maps[name] = buf
            if len(self._maps) > self.keep:
                self.forget([next(iter(self._maps))])
        self._maps.move_to_end(name)
        end = header.shm_offset + header.payload_bytes
        if end > len(buf):
            raise ValueError("shm payload runs past its segment")
        return memoryview(buf)[header.shm_offset : end]

    def forget(self, names: list[str]) -> None:
        for n in names:
            buf = self._maps.pop(n, None)
            if buf is not None:
                with contextlib.suppress(BufferError):  # a view is still alive; the GC closes it later
                    buf.close()

    def close(self) -> None:
        self.forget(list(self._maps))

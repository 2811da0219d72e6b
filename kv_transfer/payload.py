"""How payload bytes travel. Control (headers, commit, errors) always goes over gRPC.

    grpc  in the Push message itself, after the header (cross-host default)
    shm   in a /dev/shm file the sender writes and the receiver maps (same host)

A transport is a writer on the sender (`put` fills the header's location fields and
returns the in-band bytes, empty when out of band) and a reader on the receiver (`get`
returns the payload bytes the header points at). The collective transport lives in
kv_transfer/collective.py.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from typing import Protocol

import torch

from kv_transfer.wire import tensor_bytes
from protos.gen import kv_transfer_pb2 as pb

SHM_DIR = "/dev/shm"


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


class ShmWriter:
    """Writes payloads into sender-owned /dev/shm segments (bump allocation; a new segment
    when one fills). The segments are unlinked on close, after the commit was answered,
    so the receiver has read everything."""

    def __init__(self, segment_bytes: int) -> None:
        self.segment_bytes = max(segment_bytes, 1 << 20)
        self._segments: list[tuple[str, mmap.mmap]] = []
        self._offset = 0

    def _new_segment(self, need: int) -> None:
        name = f"tandem-kv-{os.getpid()}-{secrets.token_hex(6)}"
        size = max(self.segment_bytes, need)
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self._segments.append((name, mmap.mmap(fd, size)))
        finally:
            os.close(fd)
        self._offset = 0

    def put(self, header: pb.KVChunkHeader, data: torch.Tensor) -> memoryview:
        n = data.numel() * data.element_size()
        if not self._segments or self._offset + n > len(self._segments[-1][1]):
            self._new_segment(n)
        name, buf = self._segments[-1]
        dst = torch.frombuffer(buf, dtype=data.dtype, count=data.numel(), offset=self._offset)
        dst.copy_(data.reshape(-1))  # the one copy: cache gather straight into shared memory
        header.transport, header.shm_name, header.shm_offset = "shm", name, self._offset
        self._offset += n
        return memoryview(b"")

    def settle(self) -> None:
        pass

    def close(self) -> None:
        for name, buf in self._segments:
            buf.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
        self._segments.clear()


class ShmReader:
    """Maps a sender's segments on first sight; drops a mapping when the sender unlinks it."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}

    def get(self, header: pb.KVChunkHeader, inband: memoryview) -> memoryview:
        name = header.shm_name
        if "/" in name or not name.startswith("tandem-kv-"):
            raise ValueError(f"bad shm segment name {name!r}")
        buf = self._maps.get(name)
        if buf is None:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
            try:
                buf = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self._maps[name] = buf
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

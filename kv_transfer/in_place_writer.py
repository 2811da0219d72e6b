"""The sender's side of in-place transfers (kv_transfer/in_place.py): the receivers' caches
mapped once per process, a push's writer into them, and the copy from one paged cache into
another."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from kv_transfer.payload import ShmWriter
from kv_transfer.shm_files import CACHE_PREFIX, held, shm_path
from kv_transfer.wire import DTYPES, row_width
from protos.gen import kv_transfer_pb2 as pb

_PIECE_BYTES = 1 << 20  # a gather's buffer for scattered blocks: stays in cache between its two passes


class CacheMaps:
    """The receivers' caches this process writes into, each mapped on first use and kept while
    its receiver lives: a new mapping first drops those whose receiver is gone (its lock is
    free), so no dead decode worker's memory stays held here. One per process: `CACHES`."""

    def __init__(self) -> None:
        self._maps: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def get(self, res: pb.ReserveResponse) -> torch.Tensor | None:
        """The receiver's cache [layers, 2, num_blocks, block_size, kv_heads, width], writable;
        None if it is not shared or cannot be mapped here (another host, a size that does not
        match its layout)."""
        name = res.cache_shm_name
        if not name:
            return None
        with self._lock:
            if name in self._maps:
                return self._maps[name]
        L = res.layout
        shape = (L.num_layers, 2, res.cache_num_blocks, L.block_size, L.num_kv_heads, row_width(L))
        dtype = DTYPES.get(L.dtype)
        if dtype is None or not res.cache_num_blocks:
            return None
        count = torch.Size(shape).numel()
        try:
            fd = os.open(shm_path(name, CACHE_PREFIX), os.O_RDWR)
            try:
                if os.fstat(fd).st_size != count * dtype.itemsize:
                    return None
                buf = mmap.mmap(fd, count * dtype.itemsize)
            finally:
                os.close(fd)
        except (OSError, ValueError):
            return None
        kv = torch.frombuffer(buf, dtype=dtype, count=count).view(shape)
        with self._lock:
            for gone in [n for n in self._maps if not held(n, CACHE_PREFIX)]:
                del self._maps[gone]  # unmapped when its last view goes
            self._maps[name] = kv
        return kv

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._maps)


CACHES = CacheMaps()


class InPlaceWriter:
    """One push's writer: into the receiver's cache once the claim is granted, through the
    sender's own segments (`fallback`) before that or if it was refused. KVPush serialises
    `write` and `close` under its writer lock; after `close` nothing is written."""

    def __init__(self, target: torch.Tensor, claim: Future[None], fallback: ShmWriter) -> None:
        self.target = target
        self.fallback = fallback
        self._claim = claim
        self._closed = False

    @property
    def claimed(self) -> bool:
        """Whether chunks may go in place now (never blocks)."""
        return not self._closed and self._claim.done() and self._claim.exception() is None

    def wait_claimed(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the claim's answer; whether chunks now go in place. For
        callers whose first chunk is ready at once (a prefill's comes after its first layer)."""
        with contextlib.suppress(Exception):
            self._claim.result(timeout_s)
        return self.claimed

    def write(self, header: pb.KVChunkHeader, data: torch.Tensor, src: torch.Tensor | None) -> None:
        """Copy one chunk into its destination blocks (header.block_ids, layers from the header):
        `data` itself ([layers, 2, blocks, ...]) or, with `src`, those blocks of `data`."""
        if self._closed:
            raise RuntimeError("the in-place writer is closed")
        if data.dtype != self.target.dtype:  # copy_ would convert where the receiver checks
            raise ValueError(f"KV of {data.dtype} for a cache of {self.target.dtype}")
        copy_blocks(self.target[header.layer_start : header.layer_end], header.block_ids, data, src)
        header.transport = "in_place"

    def put(self, header: pb.KVChunkHeader, data: torch.Tensor) -> memoryview:
        return self.fallback.put(header, data)

    def settle(self) -> None:
        self.fallback.settle()

    def close(self) -> None:
        self._closed = True
        self._claim.cancel()
        self.fallback.close()


def copy_blocks(dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor, src_ids: torch.Tensor | None) -> None:
    """dst[:, :, dst_ids] = src[:, :, src_ids] (src_ids None: src's blocks in order), in one pass
    over memory: each run of ids consecutive on both sides is one strided copy; scattered
    blocks go in pieces through a buffer small enough to stay in cache between gather and scatter.

    dst, src: [layers, 2, blocks, block_size, kv_heads, width], the same layers."""
    n = len(dst_ids)
    s = list(range(n)) if src_ids is None else src_ids.tolist()
    if len(s) != n or dst.shape[0] != src.shape[0] or dst.shape[3:] != src.shape[3:]:
        raise ValueError(f"cannot copy {len(s)} blocks of {tuple(src.shape)} into {n} of {tuple(dst.shape)}")
    runs: list[tuple[int, int, int]] = []  # (src start, dst start, length)
    for a, b in zip(s, dst_ids, strict=True):
        if runs and a == runs[-1][0] + runs[-1][2] and b == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    if len(runs) * 4 <= n:  # runs of 4 blocks or more, on average
        for a, b, k in runs:
            dst[:, :, b : b + k].copy_(src[:, :, a : a + k])
        return
    per_block = src[:, :, :1].numel() * src.element_size()
    step = max(1, _PIECE_BYTES // per_block)
    si, di = torch.tensor(s, dtype=torch.long), torch.tensor(list(dst_ids), dtype=torch.long)
    for lo in range(0, n, step):
        dst.index_copy_(2, di[lo : lo + step], src.index_select(2, si[lo : lo + step]))

"""Same-host KV written straight into the receiver's paged cache: the payload's one copy.

    sender    own paged cache ──copy_blocks──▶ receiver's paged cache, mapped from /dev/shm
    receiver  copies nothing: a header-only chunk says which layers of which blocks are written

A decode worker's KV tensor lives in a /dev/shm segment (`SharedCache`), named in every
ReserveResponse. A sender on `--transport shm` maps it once (`CacheMaps`), Claims the
reservation, naming a holder lock, and from then on copies each chunk into the reserved
blocks and pushes its header alone (`InPlaceWriter`). Until the claim is answered, or if it
is refused, chunks go through the sender's own segments (kv_transfer/payload.py).

The fence. A sender writes without asking, so blocks it may still write are never handed to
another request. A claimed reservation that the receiver drops (lease, rejected chunk, cut
stream, its owner's abort) keeps its blocks, fenced (`Fence`), until one of:

    the sender's Release    sent only after it stopped writing (KVPush fails its writer first)
    its holder lock frees   a flock on a /dev/shm file, which the kernel drops when the
                            sender's process exits, however it exits

A commit ends the claim: every write came before the commit message. Names in /dev/shm are
locked the same way by their owners, so a file left by a killed process is swept by the next.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from engine.paged_cache import PagedKVCache
from kv_transfer.payload import SHM_DIR, ShmWriter
from kv_transfer.wire import DTYPES, row_width
from protos.gen import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

CACHE_PREFIX = "tandem-kvc-"  # a receiver's whole cache
HOLDER_PREFIX = "tandem-kvh-"  # a sender's liveness lock
_PIECE_BYTES = 1 << 20  # a gather's buffer for scattered blocks: stays in cache between its two passes


def shm_path(name: str, prefix: str) -> str:
    """The /dev/shm path of `name`. Raises ValueError unless it is one of ours with that prefix."""
    if "/" in name or not name.startswith(prefix):
        raise ValueError(f"bad shm name {name!r}")
    return os.path.join(SHM_DIR, name)


def _locked(prefix: str, nbytes: int) -> tuple[str, int]:
    """A new /dev/shm file of `nbytes` (space reserved: a full /dev/shm fails here, not as a
    SIGBUS on a later write), flock-shared by this process until it exits. Raises OSError."""
    sweep()
    name = f"{prefix}{os.getpid()}-{secrets.token_hex(6)}"
    path = shm_path(name, prefix)
    unborn = os.path.join(SHM_DIR, f".{name}")  # locked before it gets a name a sweep looks at
    fd = os.open(unborn, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
        os.rename(unborn, path)
    except OSError:
        os.close(fd)
        _unlink(unborn)
        raise
    return name, fd


def is_holder(name: str) -> bool:
    """Whether `name` could be a holder lock (a Claim names one)."""
    return name.startswith(HOLDER_PREFIX) and "/" not in name


def held(name: str, prefix: str = HOLDER_PREFIX) -> bool:
    """Whether the process that made `name` still lives (holds its lock)."""
    try:
        fd = os.open(shm_path(name, prefix), os.O_RDONLY)
    except (OSError, ValueError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def sweep() -> None:
    """Unlink caches and holder locks whose owner is gone (killed before it could unlink them)."""
    for prefix in (CACHE_PREFIX, HOLDER_PREFIX):
        for path in glob.glob(os.path.join(SHM_DIR, prefix + "*")):
            if not held(os.path.basename(path), prefix):
                _unlink(path)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


_holder: str | None = None
_holder_lock = threading.Lock()


def holder() -> str:
    """This process's holder lock (made on first use, held until exit): what a Claim names."""
    global _holder
    with _holder_lock:
        if _holder is None:
            name, _ = _locked(HOLDER_PREFIX, 0)  # the fd stays open: the lock lives with the process
            weakref.finalize(holder, _unlink, shm_path(name, HOLDER_PREFIX))
            _holder = name
        return _holder


# ---- the receiver's side ---------------------------------------------------------------------


class SharedCache:
    """A receiver's KV tensor over a /dev/shm segment. `share` moves an engine's cache there;
    the file is unlinked by `close` or at exit, and by the next sweep if the process is killed."""

    def __init__(self, name: str, fd: int, num_blocks: int) -> None:
        self.name = name
        self.num_blocks = num_blocks
        self._fd = fd
        weakref.finalize(self, _unlink, shm_path(name, CACHE_PREFIX))

    @classmethod
    def share(cls, cache: PagedKVCache) -> SharedCache | None:
        """Move `cache` into shared memory before its engine runs; None (and a warning) if
        /dev/shm cannot hold it: senders then copy through their own segments."""
        nbytes = cache.kv.numel() * cache.kv.element_size()
        fd = -1
        try:
            name, fd = _locked(CACHE_PREFIX, nbytes)
            buf = mmap.mmap(fd, nbytes)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
                _unlink(shm_path(name, CACHE_PREFIX))
            log.warning("KV cache stays private (%d MB, /dev/shm: %s): same-host transfers copy twice", nbytes >> 20, e)
            return None
        cache.rehome(torch.frombuffer(buf, dtype=cache.dtype, count=cache.kv.numel()).view(cache.kv.shape))
        return cls(name, fd, cache.num_blocks)

    def close(self) -> None:
        """Unlink the file (the mapping lives on with the cache; senders keep theirs)."""
        _unlink(shm_path(self.name, CACHE_PREFIX))


class Fence:
    """Claimed reservations dropped while their sender may still write: request id -> (token,
    holder). Their blocks stay with the engine until `lift` or `lift_dead` returns them. Not
    thread-safe: the receiver locks."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[str, str]] = {}

    def hold(self, request_id: str, token: str, holder_name: str) -> None:
        self._held[request_id] = (token, holder_name)

    def lift(self, request_id: str, token: str) -> bool:
        """The sender says it stopped writing (its Release, with the token)."""
        entry = self._held.get(request_id)
        if entry is None or not secrets.compare_digest(entry[0], token):
            return False
        del self._held[request_id]
        return True

    def lift_dead(self) -> list[str]:
        """Request ids whose sender's process is gone, no longer fenced."""
        dead = [rid for rid, (_, h) in self._held.items() if not held(h)]
        for rid in dead:
            del self._held[rid]
        return dead

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def ids(self) -> list[str]:
        return list(self._held)


# ---- the sender's side -----------------------------------------------------------------------


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

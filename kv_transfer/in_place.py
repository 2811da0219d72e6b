"""Same-host KV written straight into the receiver's paged cache: the payload's one copy.

    sender    own paged cache ──copy_blocks──▶ receiver's paged cache, mapped from /dev/shm
    receiver  copies nothing: a header-only chunk says which layers of which blocks are written

A decode worker's KV tensor lives in a /dev/shm segment (`SharedCache`), named in every
ReserveResponse. A sender on `--transport shm` maps it once, Claims the reservation, naming
a holder lock, and from then on copies each chunk into the reserved blocks and pushes its
header alone (kv_transfer/in_place_writer.py). Until the claim is answered, or if it
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

import logging
import mmap
import os
import secrets
import threading
import weakref

import torch

from engine.paged_cache import PagedKVCache
from kv_transfer.shm_files import CACHE_PREFIX, HOLDER_PREFIX, create_locked, held, shm_path, unlink

log = logging.getLogger(__name__)

_PIECE_BYTES = 1 << 20  # a gather's buffer for scattered blocks: stays in cache between its two passes


def is_holder(name: str) -> bool:
    """Whether `name` could be a holder lock (a Claim names one)."""
    return name.startswith(HOLDER_PREFIX) and "/" not in name


_holder: str | None = None
_holder_lock = threading.Lock()


def holder() -> str:
    """This process's holder lock (made on first use, held until exit): what a Claim names."""
    global _holder
    with _holder_lock:
        if _holder is None:
            name, _ = create_locked(HOLDER_PREFIX, 0)  # the fd stays open: the lock lives with the process
            weakref.finalize(holder, unlink, shm_path(name, HOLDER_PREFIX))
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
        weakref.finalize(self, unlink, shm_path(name, CACHE_PREFIX))

    @classmethod
    def share(cls, cache: PagedKVCache, contents: bool = True) -> SharedCache | None:
        """Move `cache` into shared memory before its engine runs, with its contents unless
        `contents` is False (nothing held or cached yet: the new segment's zeros do); None (and a
        warning) if /dev/shm cannot hold it: senders then copy through their own segments."""
        nbytes = cache.kv.numel() * cache.kv.element_size()
        fd = -1
        try:
            name, fd = create_locked(CACHE_PREFIX, nbytes)
            buf = mmap.mmap(fd, nbytes)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
                unlink(shm_path(name, CACHE_PREFIX))
            log.warning("KV cache stays private (%d MB, /dev/shm: %s): same-host transfers copy twice", nbytes >> 20, e)
            return None
        cache.rehome(torch.frombuffer(buf, dtype=cache.dtype, count=cache.kv.numel()).view(cache.kv.shape), contents)
        return cls(name, fd, cache.num_blocks)

    def close(self) -> None:
        """Unlink the file (the mapping lives on with the cache; senders keep theirs)."""
        unlink(shm_path(self.name, CACHE_PREFIX))


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

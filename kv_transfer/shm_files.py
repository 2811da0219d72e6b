"""Named files in /dev/shm that live as long as the process that made them.

Each is flock-shared by its maker from before it has its name until the maker exits, however
it exits; `sweep` unlinks those nobody holds. /dev/shm is memory: a file a SIGKILLed worker
left there stayed until the host rebooted (a sender's 64 MiB segments had no lock, so nothing
swept them: 15 piled up on this host in a day of tests), and a decode worker's whole cache is
up to 2 GiB. A lock works across PID namespaces sharing one /dev/shm, where a pid in the name
would not tell a dead maker from one in another container.

    tandem-kvc-<pid>-<hex>   a receiver's whole KV cache (kv_transfer/in_place.py)
    tandem-kvh-<pid>-<hex>   a sender's holder lock, empty (kv_transfer/in_place.py)
    tandem-kv-<pid>-<hex>    a sender's payload segment (kv_transfer/payload.py)
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import secrets

SHM_DIR = "/dev/shm"
CACHE_PREFIX = "tandem-kvc-"  # a receiver's whole cache
HOLDER_PREFIX = "tandem-kvh-"  # a sender's liveness lock
SEGMENT_PREFIX = "tandem-kv-"  # a sender's payload segment
PREFIXES = (CACHE_PREFIX, HOLDER_PREFIX, SEGMENT_PREFIX)


def shm_path(name: str, prefix: str) -> str:
    """The /dev/shm path of `name`. Raises ValueError unless it is one of ours with that prefix."""
    if "/" in name or not name.startswith(prefix):
        raise ValueError(f"bad shm name {name!r}")
    return os.path.join(SHM_DIR, name)


def create_locked(prefix: str, nbytes: int) -> tuple[str, int]:
    """A new /dev/shm file of `nbytes` (space reserved: a full /dev/shm fails here, not as a
    SIGBUS on a later write), flock-shared by this process until it exits or closes the fd,
    which the caller keeps: (name, fd). Sweeps first. Raises OSError."""
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
        unlink(unborn)
        raise
    return name, fd


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
    """Unlink our files whose maker is gone (killed before it could unlink them)."""
    for prefix in PREFIXES:
        for path in glob.glob(os.path.join(SHM_DIR, prefix + "*")):  # tandem-kv-* is not tandem-kvc-*
            if not held(os.path.basename(path), prefix):
                unlink(path)


def unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)

"""CoreLedger: the workers of one host lend each other their cores while they are idle.

`tandem serve` splits a host's cores among the workers on it (threads_per_worker): on 2 cores,
1P+1D runs each worker on 1 thread, so that 2 spinning OpenMP teams do not fight over 2 cores.
But the split is static, and the phases are not: on a decode-heavy mix the prefill worker is
idle most of the time while the decode worker steps on one thread at 1.6x the time of two.
Each worker of a host has a slot in a small shared file (in /dev/shm, one per cluster
namespace); its engine loop marks the slot busy before a step and idle before it waits, and
sizes each step's thread team from the slots:

    slot:  pid | base threads | busy        (SLOTS of them, 12 bytes each)

    threads = max(base, pool * base // busy_base)
        pool      = the bases of every registered worker, at most the host's cores
        busy_base = the bases of the busy workers, this one included (live pids only)

Two 1-thread workers on 2 cores: one busy alone steps on 2 threads; both busy, 1 each. A
worker that becomes busy while a peer is mid-step on borrowed threads oversubscribes the
cores for the rest of that one step; the peer's next step gives them back. No lock is taken
on the step path: a slot is written only by its owner, and a reader that sees a stale flag
is wrong for one step. Registering and leaving take the file's flock.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import struct
from pathlib import Path

SLOTS = 64
_SLOT = struct.Struct("<iii")  # pid, base threads, busy
_SIZE = SLOTS * _SLOT.size


def ledger_path(namespace: str) -> Path:
    """The host's ledger file for a cluster namespace (in /dev/shm where there is one)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"tandem-cores-{re.sub(r'[^A-Za-z0-9_.-]', '_', namespace)}"


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class CoreLedger:
    """This process's slot in its host's ledger. `claim()` before a step returns the threads to
    step with; `release()` before waiting for work; `close()` frees the slot."""

    def __init__(self, path: Path, base: int, cores: int | None = None) -> None:
        """Take a free slot (or a dead process's) in the ledger at `path`, creating the file.
        Raises ValueError for base < 1, RuntimeError when every slot is taken by a live process."""
        if base < 1:
            raise ValueError(f"base threads must be >= 1, got {base}")
        self.path, self.base = path, base
        self.cores = cores or host_cores()
        self.pid = os.getpid()
        fd = self._open_locked()
        try:
            if os.fstat(fd).st_size < _SIZE:
                os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
            try:
                self.slot = self._take_slot()
            except BaseException:
                self._map.close()
                raise
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._busy = False
        self.lent_steps = 0  # steps claimed on more threads than the base

    def _open_locked(self) -> int:
        """The ledger file, open and flocked. The last worker to leave unlinks it under the flock:
        a file this one opened before that and locked after is not the ledger any more."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def _take_slot(self) -> int:
        """Caller holds the flock."""
        for i in range(SLOTS):
            pid, _, _ = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if not pid or not _alive(pid):
                _SLOT.pack_into(self._map, i * _SLOT.size, self.pid, self.base, 0)
                return i
        raise RuntimeError(f"core ledger {self.path}: all {SLOTS} slots are taken by live processes")

    def claim(self) -> int:
        """Mark this worker busy; the threads its next step may use (>= base)."""
        if self._fd < 0:
            return self.base
        if not self._busy:
            self._set_busy(1)
        pool = busy_base = 0
        for i in range(SLOTS):
            pid, base, busy = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if not pid:
                continue
            pool += base
            if busy and (i == self.slot or _alive(pid)):
                busy_base += base
        threads = max(self.base, min(pool, self.cores) * self.base // max(busy_base, self.base))
        self.lent_steps += threads > self.base
        return threads

    def release(self) -> None:
        """Mark this worker idle: its cores go to its busy peers' next steps."""
        if self._busy and self._fd >= 0:
            self._set_busy(0)

    def _set_busy(self, busy: int) -> None:
        self._busy = bool(busy)
        _SLOT.pack_into(self._map, self.slot * _SLOT.size, self.pid, self.base, busy)

    def close(self) -> None:
        """Free the slot; the last worker to leave removes the file."""
        if self._fd < 0:
            return
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        _SLOT.pack_into(self._map, self.slot * _SLOT.size, 0, 0, 0)
        if not any(_SLOT.unpack_from(self._map, i * _SLOT.size)[0] for i in range(SLOTS)):
            self.path.unlink(missing_ok=True)
        self._map.close()
        os.close(self._fd)  # drops the flock
        self._fd = -1

    def check_integrity(self) -> None:
        """This process holds its slot, with its own base."""
        if self._fd < 0:
            return
        pid, base, _ = _SLOT.unpack_from(self._map, self.slot * _SLOT.size)
        if (pid, base) != (self.pid, self.base):
            raise AssertionError(f"core ledger slot {self.slot} holds pid {pid}, base {base}; expected "
                                 f"pid {self.pid}, base {self.base}")  # fmt: skip

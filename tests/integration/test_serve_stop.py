"""`tandem serve` stopped the way systemd stops a service: SIGTERM to every process of its
group at once, so Ray's raylet and GCS die beside it and Ray stops answering its shutdown.
It used to wait 90 s on Ray's client and die with a fatal error; every shutdown step is now
bounded (cluster/shutdown.py), so it exits 0 and leaves no process behind. And a SIGTERM
while the workers load stops the start, also with 0 (router/stopping.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from tests.integration.waits import until
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
READY_S = 180.0  # a cold start here: ~15 s
STOP_S = 60.0  # measured 10.6-12.2 s; the hang it replaced lasted ~90 s


def in_session(sid: int) -> list[int]:
    """The live processes of session `sid` (Ray's workers make groups of their own in it)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except ProcessLookupError:
                pass
    return pids


def ready(url: str, proc: subprocess.Popen[str]) -> bool:
    assert proc.poll() is None, f"tandem serve exited ({proc.returncode}) before it was ready"
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Serve:
    proc: subprocess.Popen[str]
    url: str
    log: IO[str]

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stopped_cleanly(self, code: int) -> None:
        until(lambda: not in_session(self.proc.pid), 30, "every process of the service to be gone")
        out = self.output()
        assert code == 0, out[-3000:]
        assert "tandem: stopped" in out and "Traceback" not in out, out[-3000:]


@contextlib.contextmanager
def serve(tmp_path: Path) -> Iterator[Serve]:
    """`tandem serve --colocated 1` in a session of its own, with a Ray of its own."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = (tmp_path / "serve.log").open("w+")
    cmd = [sys.executable, "-m", "cli.main", "serve", "--colocated", "1", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log, text=True, start_new_session=True)
    try:
        yield Serve(proc, f"http://127.0.0.1:{port}", log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in in_session(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.close()


def test_a_whole_process_group_sigterm_stops_serve_cleanly(tmp_path: Path) -> None:
    with serve(tmp_path) as s:
        until(lambda: ready(s.url, s.proc), READY_S, "tandem serve to be ready")
        chat = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        assert httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
        os.killpg(s.proc.pid, signal.SIGTERM)  # systemd's KillMode=control-group
        s.stopped_cleanly(s.proc.wait(timeout=STOP_S))


def test_a_sigterm_while_the_workers_load_stops_serve_cleanly(tmp_path: Path) -> None:
    """Once Ray is up, its core worker's own SIGTERM handler aborted the process (exit 134)."""
    with serve(tmp_path) as s:
        until(lambda: "Started a local Ray instance" in s.output(), READY_S, "Ray to start")
        assert s.proc.poll() is None and "ready in" not in s.output()
        s.proc.send_signal(signal.SIGTERM)
        s.stopped_cleanly(s.proc.wait(timeout=STOP_S))
        assert "ready in" not in s.output()  # it stopped loading, not serving

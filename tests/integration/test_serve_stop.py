"""`tandem serve` stopped the way systemd stops a service: SIGTERM to every process of its
group at once, so Ray's raylet and GCS die beside it and Ray stops answering its shutdown.
It used to wait 90 s on Ray's client and die with a fatal error; every shutdown step is now
bounded (cluster/shutdown.py), so it exits 0 and leaves no process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from tests.integration.waits import until

ROOT = Path(__file__).resolve().parents[2]
READY_S = 180.0  # a cold start here: ~15 s
STOP_S = 60.0  # measured 10.6-12.2 s; the hang it replaced lasted ~90 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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


def test_a_whole_process_group_sigterm_stops_serve_cleanly(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of its own
    log = (tmp_path / "serve.log").open("w+")
    cmd = [sys.executable, "-m", "cli.main", "serve", "--colocated", "1", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log, text=True, start_new_session=True)
    try:
        until(lambda: ready(url, proc), READY_S, "tandem serve to be ready")
        assert (
            httpx.post(
                f"{url}/v1/chat/completions",
                json={
                    "model": "SmolLM2-135M-Instruct",
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4,
                },
                timeout=60,
            ).status_code
            == 200
        )
        os.killpg(proc.pid, signal.SIGTERM)  # systemd's KillMode=control-group
        code = proc.wait(timeout=STOP_S)
        until(lambda: not in_session(proc.pid), 30, "every process of the service to be gone")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in in_session(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    log.seek(0)
    out = log.read()
    assert code == 0, out[-3000:]
    assert "tandem: stopped" in out and "Traceback" not in out, out[-3000:]

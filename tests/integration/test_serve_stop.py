"""`tandem serve` stopped the way systemd stops a service: SIGTERM to every process of its
group at once, so Ray's raylet and GCS die beside it and Ray stops answering its shutdown.
It used to wait 90 s on Ray's client and die with a fatal error; every shutdown step is now
bounded (cluster/shutdown.py), so it exits 0 and leaves no process behind. And a SIGTERM
while the workers load stops the start, also with 0 (router/stopping.py). A frozen pool manager
is killed rather than waited for. A raylet that dies stops serve, with exit 1."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import ray

from cluster.cluster import Cluster, ClusterConfig
from cluster.manager_link import MANAGER_PING_S
from engine.config import EngineConfig
from router.ray_watch import GONE_AFTER_S
from tests.integration.waits import until
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
READY_S = 180.0  # a cold start here: ~15 s
STOP_S = 60.0  # measured 0.3-0.9 s (10.6-12.2 s before the GCS check); the hang it replaced lasted ~90 s
FROZEN_MANAGER_STOP_S = MANAGER_PING_S + 8.0  # the kills after the ping: ~1 s; it used to take 20 s


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


def described(pids: list[int]) -> list[str]:
    """`pid command line` for each of `pids` still there."""
    out = []
    for pid in pids:
        with contextlib.suppress(OSError):
            out.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes().replace(bytes(1), b' ').decode()[:160]}")
    return out


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
        out = self.output()
        try:
            until(lambda: not in_session(self.proc.pid), 30, "every process of the service to be gone")
        except AssertionError as e:
            raise AssertionError(f"{e}: {described(in_session(self.proc.pid))}\n{out[-3000:]}") from None
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
        # its GCS refused: no Ray step was tried, to wait out its bound (10 s) for nothing
        assert "did not return within" not in s.output(), s.output()[-3000:]


def test_a_sigterm_while_the_workers_load_stops_serve_cleanly(tmp_path: Path) -> None:
    """Once Ray is up, its core worker's own SIGTERM handler aborted the process (exit 134)."""
    with serve(tmp_path) as s:
        # the worker's actor placed (tandem serve's progress line); not Ray's "Started a local Ray
        # instance", which ray.init logs before it connects: a SIGTERM from there until ray.init
        # returns can meet the C handler its core worker puts in, which aborts (README, "Stopping
        # never hangs")
        until(lambda: " colocated starting" in s.output(), READY_S, "the worker to start loading")
        assert s.proc.poll() is None and "ready in" not in s.output()
        s.proc.send_signal(signal.SIGTERM)
        s.stopped_cleanly(s.proc.wait(timeout=STOP_S))
        assert "ready in" not in s.output()  # it stopped loading, not serving


def test_a_frozen_pool_manager_is_killed_not_waited_for() -> None:
    """Cluster.shutdown with the pool manager SIGSTOPped: the ping before its shutdown call
    gives up after MANAGER_PING_S, and the kill steps take it and its worker down. (Its
    shutdown call alone waited 20 s.)"""
    engine = EngineConfig(dtype="fp32", num_blocks=64, num_threads=1)
    c = Cluster.connect(ClusterConfig(namespace="frozen-manager", prefill=0, decode=0, colocated=1, engine=engine))
    namespace = f"tandem-{c.config.namespace}"
    status = c.manager_status()
    assert status is not None and status.pid
    until(lambda: len(named(namespace)) == 2, 60, "the worker's actor beside the pool manager's")
    until(lambda: all("pid" in w for w in c.workers()) and len(c.workers()) == 1, 60, "the worker's heartbeat")
    pids = [status.pid, *(int(w["pid"]) for w in c.workers())]
    os.kill(status.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        outcome = c.shutdown()
        took = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(status.pid, signal.SIGCONT)
    assert took < FROZEN_MANAGER_STOP_S, (took, outcome)
    assert outcome.ray_answered and not outcome.left_behind, outcome
    # their processes, not named(): after the Cluster's ray.shutdown, a Ray API call would start a
    # Ray of its own here, without the role slots, which the next test's Cluster would then join
    until(lambda: not [pid for pid in pids if alive(pid)], 30, "the pool manager and its worker to be gone")
    assert not ray.is_initialized()


def alive(pid: int) -> bool:
    """A process that runs (a zombie waiting to be reaped does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def named(namespace: str) -> list[str]:
    """The named actors alive in `namespace`."""
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]


def test_a_dead_raylet_stops_serve_with_exit_1(tmp_path: Path) -> None:
    """The raylet killed: its node's actors are dead to Ray while their processes, orphaned,
    heartbeat on, so `/ready` said 200 and every request got a 503 for as long as serve ran.
    Now serve stops (router.ray_watch), exits 1 for a supervisor to restart it, and leaves no
    process behind."""
    with serve(tmp_path) as s:
        until(lambda: ready(s.url, s.proc), READY_S, "tandem serve to be ready")
        raylets = [line for line in described(in_session(s.proc.pid)) if "/raylet" in line.split(" ")[1]]
        assert len(raylets) == 1, described(in_session(s.proc.pid))
        os.kill(int(raylets[0].split(" ")[0]), signal.SIGKILL)
        code = s.proc.wait(timeout=GONE_AFTER_S + STOP_S)
        out = s.output()
        assert code == 1 and "this host's Ray node is gone (its raylet stopped); stopping" in out, out[-3000:]
        assert out.rstrip().endswith("tandem: stopped"), out[-3000:]
        until(lambda: not in_session(s.proc.pid), 30, "every process of the service to be gone")

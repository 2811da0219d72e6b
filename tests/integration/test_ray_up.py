"""`ray up` / `ray down` of deploy/cluster.local.yaml on this machine, over ssh to 127.0.0.1.

Installs openssh-server and rsync (Debian), starts sshd on 127.0.0.1 only with a key that
is accepted from 127.0.0.1 only, brings the cluster up, asks the router for a chat
completion and the pools, starts a second router on the same pools and stops it (the pools
stay), another that is SIGKILLed while a long prompt of its own prefills (the KV reserved for it is
freed) and another SIGKILLed mid-stream (its stream stops), brings the cluster
down, and checks that no Ray process is left and that the router stopped by itself, cleanly.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = ROOT / ".venv" / "bin"
KEY = Path.home() / ".ssh" / "tandem_loopback"
LINK = Path.home() / "tandem-loopback"
PROFILE = Path("/etc/profile.d/tandem-loopback.sh")
URL = "http://127.0.0.1:8000"
SECOND_URL = "http://127.0.0.1:8001"
SECOND_LOG = Path("/tmp/tandem-loopback-serve-2.log")
REDIS_PID = Path("/tmp/tandem-loopback-redis.pid")
KILLED_ROUTER_S = 15  # Outboxes.lost_s (3 s), its reaper's tick and a heartbeat; the orphan wait is 30 s
# Outboxes.lost_s, the idle feed frame that finds the feed broken (1 s), the reaper's tick and a heartbeat;
# a reservation's lease ends 10 s after the router's last renewal
RELEASED_S = 8
GONE_S = 30  # after `ray down`, for the joined router to stop: ray_watch.GONE_AFTER_S and its own stop

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("apt-get") or not (VENV_BIN / "ray").exists(),
    reason="needs root, apt-get and the project's .venv (it installs and starts sshd)",
)


def sh(cmd: str, timeout: float, check: bool = True, env: dict[str, str] | None = None) -> str:
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False)
    if check and p.returncode != 0:
        raise AssertionError(f"`{cmd}` failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p.stdout


def wait_ready(url: str, timeout_s: float, log: Path) -> None:
    end = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < end, f"the router at {url} never became ready:\n{log.read_text()[-3000:]}"
        time.sleep(1)


def chat(url: str) -> str:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    text: str = r.json()["choices"][0]["message"]["content"]
    assert text
    return text


def pools(url: str, token: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/admin/pools", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert r.status_code == 200, r.text
    found: list[dict[str, Any]] = r.json()["workers"]
    return found


def workers(url: str, token: str) -> dict[str, str]:
    return {w["worker_id"]: w["role"] for w in pools(url, token)}


def start_router(env: dict[str, str], token: str) -> subprocess.Popen[bytes]:
    """Another `tandem serve --join` on the loopback cluster's Ray and Redis, on 8001, asked for
    other sizes than the pools have."""
    redis_url = f"redis://:{token}@127.0.0.1:6391/0"
    env = {**env, "RAY_ADDRESS": "127.0.0.1:6390", "REDIS_URL": redis_url, "TANDEM_ADMIN_TOKEN": token}
    with SECOND_LOG.open("w") as out:
        proc = subprocess.Popen(
            [str(VENV_BIN / "tandem"), "serve", "--join", "--port", "8001", "--prefill", "2", "--dtype", "fp32"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )  # fmt: skip
    wait_ready(SECOND_URL, 120, SECOND_LOG)
    return proc


def second_router(env: dict[str, str], token: str) -> None:
    """A second router (as a restarted one is) joins the pools as they are, answers as the first
    does, and on SIGTERM stops alone; the first serves on over the same workers."""
    first = workers(URL, token)
    proc = start_router(env, token)
    try:
        assert workers(SECOND_URL, token) == first
        assert chat(SECOND_URL) == chat(URL)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, SECOND_LOG.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    log = SECOND_LOG.read_text()
    assert "joined the pools running in namespace 'default' (1 prefill, 1 decode)" in log, log[-3000:]
    assert "leaving the pools running" in log and log.rstrip().endswith("tandem: stopped"), log[-3000:]
    assert workers(URL, token) == first
    chat(URL)


def killed_router(env: dict[str, str], token: str) -> None:
    """A router SIGKILLed mid-stream: the decode worker drops its stream within KILLED_ROUTER_S
    (its feed breaks; cluster/feed_channel.py), where it used to decode on for 37 s."""
    proc = start_router(env, token)
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    running = lambda: sum(int(w.get("running") or 0) for w in pools(URL, token))  # noqa: E731
    try:
        with httpx.stream("POST", f"{SECOND_URL}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            end = time.monotonic() + 10
            while not running():  # as the worker's heartbeat says
                assert time.monotonic() < end, "the stream never showed in the pools"
                time.sleep(0.2)
            proc.kill()
            killed = time.monotonic()
            with contextlib.suppress(httpx.HTTPError):
                for _ in lines:
                    pass
    finally:
        proc.kill()
        proc.wait(10)
    wait_while(running, killed, KILLED_ROUTER_S)
    assert not running(), f"a killed router's stream still decodes {KILLED_ROUTER_S} s on"


def wait_while(still: Callable[[], bool], since: float, limit_s: float) -> float:
    """Poll `still` until it is false or `limit_s` has passed since `since`; the seconds since."""
    while still() and time.monotonic() - since < limit_s:
        time.sleep(0.25)
    return time.monotonic() - since


def killed_router_mid_prefill(env: dict[str, str], token: str) -> None:
    """A router SIGKILLed while a long prompt of its own prefills, with no stream on the decode
    worker: the KV reserved there for it is freed within RELEASED_S (its feed to that worker was
    open before it reserved, cluster/handoff.py), not at the lease's end."""
    proc = start_router(env, token)
    content = "Sum up this list: " + " ".join(f"item {i}," for i in range(1200))  # ~3.6K tokens
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    reserved = lambda: sum(int(w.get("reservations") or 0) for w in pools(URL, token))  # noqa: E731

    answered: list[str] = []

    def ask() -> None:
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.post(f"{SECOND_URL}/v1/chat/completions", json=body, timeout=120)
            answered.append(f"{r.status_code} {r.text[:500]}")

    asking = threading.Thread(target=ask, daemon=True)
    try:
        asking.start()
        end = time.monotonic() + 30
        while not reserved():
            assert time.monotonic() < end and asking.is_alive(), f"no reservation showed in the pools; {answered}"
            time.sleep(0.1)
        proc.kill()
        killed = time.monotonic()
    finally:
        proc.kill()
        proc.wait(10)
    freed_s = wait_while(reserved, killed, RELEASED_S)
    assert not reserved(), f"a killed router's reservation still holds KV {RELEASED_S} s on"
    print(f"\na killed router's reservation was freed {freed_s:.1f} s after its SIGKILL")
    asking.join(30)


def ray_processes() -> str:
    return sh(
        "pgrep -fa 'raylet|gcs_server|tandem serve --join|tandem-loopback.*redis-server' | grep -v pgrep || true", 10
    )


@pytest.fixture(scope="module")
def sshd() -> Iterator[None]:
    if not Path("/usr/sbin/sshd").exists() or not shutil.which("rsync"):
        sh("apt-get update -qq", 600)
        sh("DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server rsync", 900)
    KEY.parent.mkdir(mode=0o700, exist_ok=True)
    if not KEY.exists():
        sh(f"ssh-keygen -q -t ed25519 -N '' -f {KEY}", 30)
    auth = KEY.parent / "authorized_keys"
    entry = f'from="127.0.0.1" {KEY.with_suffix(".pub").read_text().strip()}'
    if entry not in (auth.read_text() if auth.exists() else ""):
        with auth.open("a") as f:
            f.write(entry + "\n")
    auth.chmod(0o600)
    sh("ssh-keygen -A && mkdir -p /run/sshd", 60)
    pidfile = Path("/tmp/tandem-loopback-sshd.pid")
    sh(
        "/usr/sbin/sshd -o ListenAddress=127.0.0.1 -o Port=22 -o PasswordAuthentication=no "
        f"-o PermitRootLogin=prohibit-password -o PidFile={pidfile}",
        30,
    )
    ssh = f"ssh -i {KEY} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes root@127.0.0.1"
    end = time.monotonic() + 30
    while subprocess.run(f"{ssh} true", shell=True, capture_output=True, timeout=15, check=False).returncode:
        assert time.monotonic() < end, "sshd on 127.0.0.1 does not accept the loopback key"
        time.sleep(1)
    yield
    if pidfile.exists():
        sh(f"kill $(cat {pidfile})", 10, check=False)


def test_ray_up_chat_pools_ray_down(sshd: None) -> None:
    if LINK.is_symlink() or not LINK.exists():
        LINK.unlink(missing_ok=True)
        LINK.symlink_to(ROOT)
    # `ray down` runs a bare `ray stop` in a login shell: put the venv on that PATH.
    PROFILE.write_text(f'export PATH="{VENV_BIN}:$PATH"\n')
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
    }
    env.pop("RAY_ADDRESS", None)
    sh("ray up -y --no-config-cache deploy/cluster.local.yaml", 900, env=env)
    try:
        wait_ready(URL, 300, Path("/tmp/tandem-loopback-serve.log"))
        chat(URL)
        token = (Path.home() / ".tandem_redis_password").read_text().strip()
        assert {"prefill", "decode"} <= set(workers(URL, token).values())
        second_router(env, token)
        killed_router_mid_prefill(env, token)
        killed_router(env, token)
    finally:
        sh("ray down -y deploy/cluster.local.yaml", 300, check=False, env=env)
        if REDIS_PID.exists():  # the cluster's Redis, which `ray down` leaves (a head node's own goes with it)
            sh(f"kill $(cat {REDIS_PID})", 10, check=False)
        # the router notices (router.ray_watch) and stops by itself; it used to wait out Ray's
        # 60 s GCS reconnect and die of Ray's fatal error
        end = time.monotonic() + GONE_S
        while ray_processes().strip() and time.monotonic() < end:
            time.sleep(1)
        PROFILE.unlink(missing_ok=True)
    assert not ray_processes().strip(), f"left behind {GONE_S} s after ray down:\n{ray_processes()}"
    log = Path("/tmp/tandem-loopback-serve.log").read_text()
    assert "the Ray cluster is gone; stopping" in log and log.rstrip().endswith("tandem: stopped"), log[-2000:]

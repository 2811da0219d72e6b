"""Workers whose engine cannot be built, on real Ray and Redis: Cluster.wait_ready stops at once
with the reason, and each death is an event that says it, instead of a wait of its whole timeout
while the pool restarts them every round (cluster/start_failures.py; its backoff is unit-tested)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from cluster.cluster import Cluster, ClusterConfig
from cluster.start_failures import GIVE_UP_AFTER, WorkersCannotStart
from engine.config import EngineConfig
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_workers_that_cannot_build_their_engine_stop_wait_ready_with_the_reason() -> None:
    # the int8 kernel asked for by name, on workers without the C library: every start fails
    engine = EngineConfig(dtype="int8", num_blocks=64, num_threads=1, prefill_attention="int8")
    c = Cluster.connect(ClusterConfig(namespace="startfail", engine=engine, worker_env={"TANDEM_NATIVE": "0"}))
    try:
        t = time.monotonic()
        with pytest.raises(WorkersCannotStart, match=r"not available \(no C library here\): use auto or torch"):
            c.wait_ready(150)
        assert time.monotonic() - t < 100, "it waited out the timeout"
        status = c.manager_status()
        assert status is not None
        failures = {f.role: f for f in status.start_failures}
        assert any(f.count >= GIVE_UP_AFTER for f in failures.values())  # the pool that gave up
        assert all("prefill_attention 'int8' is not available" in f.reason for f in failures.values())
        shown = c.status()["start_failures"]  # what /admin/pools shows
        assert shown and all("prefill_attention 'int8' is not available" in f["reason"] for f in shown)
        downs = [f for _, f in c.state.events(count=500) if f.get("kind") == "worker_down"]
        assert downs and all(f["reason"].startswith("failed to start: ValueError: prefill_attention") for f in downs)
    finally:
        c.shutdown()


def test_serve_whose_workers_cannot_start_says_why_and_exits_1() -> None:
    """`tandem serve` with a kernel its workers cannot run: one line, no traceback, exit 1, after
    stopping what it started (it ran 180 s, then printed a TimeoutError's traceback)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"TANDEM_NATIVE": "0"}
    cmd = [sys.executable, "-m", "cli.main", "serve", "--colocated", "1", "--prefill-attention", "int8",
           "--port", str(free_port())]  # fmt: skip
    t = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, start_new_session=True)
    assert done.returncode == 1, done.stderr[-3000:]
    assert time.monotonic() - t < 150
    assert "tandem serve: colocated workers fail to start (2 in a row): ValueError: prefill_attention 'int8' is " \
           "not available (no C library here): use auto or torch" in done.stderr  # fmt: skip
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout
    assert "tandem: stopped" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: cuda workers would start")
def test_serve_on_cuda_without_a_gpu_says_so_at_once() -> None:
    """Ray keeps a worker that claims a GPU it lacks pending, silently: serve waited 180 s."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "cli.main", "serve", "--device", "cuda", "--port", str(free_port())]
    t = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, start_new_session=True)
    assert done.returncode == 1, done.stderr[-3000:]
    assert time.monotonic() - t < 90
    assert "workers fail to start: device cuda claims 1 GPU a worker; the Ray started here has 0" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_ray_without_the_role_slots_is_refused_at_once() -> None:
    """A Ray that something else in this process started (a bare ray.init: what a Ray API call
    after a Cluster's shutdown does) has no role slots: its workers could never be placed."""
    if ray.is_initialized():  # one left by an earlier test would have its slots
        ray.shutdown()
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        c = Cluster.connect(ClusterConfig(namespace="noslots", engine=EngineConfig(dtype="int8", num_threads=1)))
        try:
            with pytest.raises(WorkersCannotStart, match=r"the Ray here has no '(prefill|decode)' worker slots"):
                c.wait_ready(60)
        finally:
            c.shutdown()
    finally:
        ray.shutdown()

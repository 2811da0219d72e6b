"""`tandem profile` on the real model, alone and beside a busy peer (a second engine decoding in
its own process), with no peer process left after."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from planner.measure import main
from planner.profile import PEER_SOURCE, EngineProfile


def test_a_profile_beside_a_busy_peer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "busy.json"
    args = ["--quick", "--threads", "1", "--transports", "", "--node-class", "cpu:test", "--json"]
    assert main([*args, "--beside-busy-peer", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    busy = EngineProfile.load(out)
    assert report["node_class"] == busy.node_class == "cpu:test:busy-peer" and busy.source == PEER_SOURCE
    assert len(busy.prefill) == 3 and len(busy.decode) == 2 and busy.threads == 1
    assert all(p.seconds > 0 for p in (*busy.prefill, *busy.decode))
    assert not multiprocessing.active_children()  # the peer was stopped and reaped

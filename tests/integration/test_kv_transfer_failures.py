"""A peer process killed mid-transfer: the other side gets its blocks back, or a typed error, in seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from engine.model import LlamaModel
from engine.sampling_params import SamplingParams
from kv_transfer.errors import KVTransferError
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVTransferClient
from kv_transfer.server import KVTransferServer
from kv_transfer.streaming import LayerStreamer
from tests.unit.tiny import TINY, make_engine, tiny_weights

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.kv_peer", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def first_line(proc: subprocess.Popen[str], timeout: float = 60) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    t.start()
    t.join(timeout)
    assert box and box[0], "peer process did not start"
    return box[0].strip()


@pytest.fixture
def model() -> LlamaModel:
    return LlamaModel(TINY, tiny_weights(), torch.float32)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    ps: list[subprocess.Popen[str]] = []
    yield ps
    for p in ps:
        p.kill()
        p.wait(10)


def test_sender_killed_mid_stream_frees_the_reservation(model: LlamaModel, procs: list) -> None:
    engine = make_engine(model, num_blocks=64, role="decode")
    receiver = KVReceiver(engine, threading.RLock(), lease_s=30)  # the lease is not what saves us
    server = KVTransferServer(receiver).start()
    try:
        sender = spawn("sender", server.endpoint)
        procs.append(sender)
        assert first_line(sender) == "sent"
        assert "victim" in receiver.table and receiver.table.get("victim").chunks > 0  # type: ignore[union-attr]
        killed = time.monotonic()
        sender.send_signal(signal.SIGKILL)
        while "victim" in receiver.table and time.monotonic() - killed < 5:
            time.sleep(0.05)
        freed_after = time.monotonic() - killed
        assert "victim" not in receiver.table, "reservation still held 5 s after the sender died"
        assert engine.kv.num_free_blocks == 64
        receiver.check_integrity()
        with pytest.raises(KVTransferError):
            receiver.wait("victim", 0.1)
        print(f"receiver freed the reservation {freed_after:.2f} s after the sender was killed")
    finally:
        server.stop(0)


def test_receiver_killed_mid_stream_gives_the_sender_a_typed_error(model: LlamaModel, procs: list) -> None:
    peer = spawn("receiver")
    procs.append(peer)
    endpoint = first_line(peer)
    prefill = make_engine(model, num_blocks=64, role="prefill", max_num_batched_tokens=8)
    streamer = LayerStreamer(prefill)
    client = KVTransferClient(endpoint, timeout_s=3)
    prompt = list(range(1, 41))
    res = client.reserve("r", len(prompt))
    push = client.push("r", res, deadline_s=3)
    streamer.track("r", push)
    prefill.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0))
    prefill.step()  # the first chunk goes out
    peer.send_signal(signal.SIGKILL)
    peer.wait(10)
    t = time.monotonic()
    with pytest.raises(KVTransferError):
        while prefill.has_unfinished():
            prefill.step()
        push.commit(len(prompt))
    elapsed = time.monotonic() - t
    assert elapsed < 5, f"typed error took {elapsed:.1f} s"
    streamer.untrack("r")
    prefill.abort("r")
    prefill.check_integrity()
    assert prefill.kv.num_free_blocks == 64
    client.close()

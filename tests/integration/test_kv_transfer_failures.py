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
from kv_transfer.errors import KVTransferError, TransferTimeout
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVTransferClient
from kv_transfer.server import KVTransferServer
from kv_transfer.streaming import LayerStreamer
from tests.integration.kv_peer import SECRET
from tests.integration.waits import until
from tests.unit.tiny import TINY, make_engine, tiny_weights

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def received_chunks(receiver: KVReceiver, request_id: str) -> int:
    held = receiver.table.get(request_id)
    return held.chunks if held is not None else 0


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
    server = KVTransferServer(receiver, secret=SECRET).start()
    try:
        sender = spawn("sender", server.endpoint)
        procs.append(sender)
        assert first_line(sender) == "sent"
        until(lambda: received_chunks(receiver, "victim") > 0, 30, "the sender's chunks")
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
    client = KVTransferClient(endpoint, timeout_s=3, secret=SECRET)
    prompt = list(range(1, 41))
    res = client.reserve("r", len(prompt))
    push = client.push("r", res, stall_s=3)
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


def test_a_stopped_receiver_never_makes_send_wait(model: LlamaModel, procs: list) -> None:
    """SIGSTOP the decode peer mid-stream: its socket fills, then its push's queue stops draining.
    Every send still returns at once; the transfer fails typed at its stall deadline; a transfer
    to a healthy peer, from the same thread, completes meanwhile."""
    peer = spawn("receiver")
    procs.append(peer)
    stuck_client = KVTransferClient(first_line(peer), timeout_s=3, secret=SECRET)
    healthy = make_engine(model, num_blocks=64, role="decode")
    receiver = KVReceiver(healthy, threading.RLock())
    server = KVTransferServer(receiver, secret=SECRET).start()
    good_client = KVTransferClient(server.endpoint, secret=SECRET)
    try:
        res = stuck_client.reserve("victim", 200)
        push = stuck_client.push("victim", res, stall_s=1.0)
        data = torch.randn(1, 2, 50, 4, 2, 16)  # one layer of 50 blocks: 50 KiB a send
        push.send(0, 1, list(range(50)), data)
        peer.send_signal(signal.SIGSTOP)
        stopped, longest, good_done = time.monotonic(), 0.0, False
        while push.error is None and time.monotonic() - stopped < 30:
            t = time.perf_counter()
            push.send(0, 1, list(range(50)), data)
            longest = max(longest, time.perf_counter() - t)
            if not good_done and time.monotonic() - stopped > 0.5:  # the peer is wedged by now
                good = good_client.push("good", good_client.reserve("good", 8))
                for layer in range(TINY.num_layers):
                    good.send(layer, layer + 1, [0, 1], torch.randn(1, 2, 2, 4, 2, 16))
                good.commit(8)
                receiver.wait("good", 1.0)
                good_done = push.error is None  # it finished while the other was still stuck
            time.sleep(0.002)  # a prefill's pace, not a spin
        failed_after = time.monotonic() - stopped
        assert isinstance(push.error, TransferTimeout), push.error
        # a send that waited on the wedged peer would take the stall (1 s); 0.5 s leaves room for
        # a busy machine's scheduling hiccups (58 ms seen under CI load) without hiding a wait
        assert longest < 0.5, f"a send took {longest * 1000:.0f} ms"
        assert good_done, "the healthy transfer did not complete while the stopped one was pending"
        with pytest.raises(TransferTimeout):
            push.commit(200)
        assert receiver.release("good", None, "test done")
        assert healthy.kv.num_free_blocks == 64
        receiver.check_integrity()
        print(f"send: at most {longest * 1000:.1f} ms; the stopped transfer failed {failed_after:.2f} s after SIGSTOP")
    finally:
        peer.send_signal(signal.SIGCONT)
        good_client.close()
        stuck_client.close()
        server.stop(0)

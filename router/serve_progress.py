"""What `tandem serve` prints while its cluster starts: the workers' states as they change, and
the ready line's KV room."""

from __future__ import annotations

import threading
import time
from typing import Any


def progress(cluster: Any, done: threading.Event, started: float) -> None:
    last = ""
    while not done.wait(1.0):
        try:
            ws = cluster.workers()
        except Exception:
            continue
        line = ", ".join(f"{w['worker_id']} {w['role']} {w['state']}" for w in ws) or "no worker yet"
        if line != last:
            print(f"  [{time.monotonic() - started:5.1f} s] {line}", flush=True)
            last = line


def kv_room(cluster: Any) -> str:
    """The ready line's tail: the KV tokens a worker holds (each count seen), from the workers'
    heartbeats; with --num-blocks auto each sized its cache from its host's memory."""
    try:
        blocks = sorted({int(w["num_blocks"]) for w in cluster.workers() if w.get("num_blocks")})
    except Exception:
        return ""
    tokens = " / ".join(f"{n * cluster.config.engine.block_size:,}" for n in blocks)
    return f", KV for {tokens} tokens a worker" if blocks else ""

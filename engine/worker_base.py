"""What every worker shares: an engine on its own loop thread, draining, stats, integrity.

No Ray and no network here; the Ray actors in cluster/ wrap these classes.
"""

from __future__ import annotations

import os
import time
from typing import Any

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import EngineError
from engine.loop import EngineLoop


class WorkerDraining(EngineError):
    """The worker is draining: it finishes what it has and takes nothing new."""


class WorkerBase:
    role = "both"

    def __init__(self, worker_id: str, model_path: str, config: EngineConfig) -> None:
        t = time.monotonic()
        self.worker_id = worker_id
        self.config = config
        self.engine = Engine.from_path(model_path, config)
        self.loop = EngineLoop(self.engine).start()
        self.draining = False
        self.load_s = time.monotonic() - t

    def ping(self) -> str:
        return self.worker_id

    def drain(self) -> None:
        """Stop taking new requests; in-flight ones run to completion."""
        self.draining = True

    def _check_open(self) -> None:
        if self.draining:
            raise WorkerDraining(f"worker {self.worker_id} is draining")

    def idle(self) -> bool:
        return bool(self.loop.call(lambda e: not e.has_unfinished())) and self.loop.num_streams == 0

    def abort(self, request_id: str) -> bool:
        return self.loop.abort(request_id)

    def stats(self) -> dict[str, Any]:
        def read(e: Engine) -> dict[str, Any]:
            return {
                "worker_id": self.worker_id,
                "role": self.role,
                "pid": os.getpid(),
                "draining": self.draining,
                "running": len(e.scheduler.running),
                "waiting": e.scheduler.num_waiting,
                "free_blocks": e.kv.num_free_blocks,
                "num_blocks": e.config.num_blocks,
                "kv_usage": e.kv.usage,
                "steps": self.loop.steps,
                "load_s": self.load_s,
            }

        result: dict[str, Any] = self.loop.call(read)
        return result

    def check_integrity(self) -> None:
        self.loop.check_integrity()

    def shutdown(self) -> None:
        self.loop.stop()

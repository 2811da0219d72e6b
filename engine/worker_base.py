"""What every worker shares: an engine on its own loop thread, draining, stats, integrity.

No Ray and no network here; the Ray actors in cluster/ wrap these classes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core_ledger import CoreLedger
from engine.engine import Engine
from engine.errors import WorkerDraining
from engine.loop import EngineLoop
from engine.messages import TokenOutput
from engine.outbox import Item, Outboxes
from engine.role_switch import switch_role
from engine.roles import Role
from engine.sampling_params import SamplingParams
from engine.spans import WorkerSpans, provider_from_env
from engine.torch_threads import on_spent_thread

log = logging.getLogger(__name__)

# How long stats() waits for the engine lock before it answers with the last figures it read.
STATS_WAIT_S = 0.05
# A call's last output is on its way to the caller when the call returns: idle() waits this long
# after the last one so that a drain never ends (and kills) a worker under an output in flight.
IDLE_SETTLE_S = 0.5


def device_label(device: torch.device) -> str:
    """What a worker computes on, for its registry entry and /admin/pools: "cpu, 2 threads",
    or "cuda:0 NVIDIA H200, 141 GB"."""
    if device.type != "cuda":
        return f"{device.type}, {torch.get_num_threads()} threads"
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return f"cuda:{index} {props.name}, {props.total_memory / 1e9:.0f} GB"


class WorkerBase:
    role: Role = "colocated"

    def __init__(self, worker_id: str, model_path: str, config: EngineConfig, core: WorkerBase | None = None) -> None:
        """`core`: an idle worker of another role whose engine, loop and outboxes this one takes
        over (a role flip: nothing reloads; `load_s` is then the switch's time). Its role's own
        parts must be closed (`close_role`). Raises ValueError as engine.role_switch."""
        t = time.monotonic()
        self.worker_id = worker_id
        self.config = config
        if core is None:
            # built off this thread, so that the loop's thread holds the process's only OpenMP team
            self.engine = on_spent_thread(lambda: Engine.from_path(model_path, config))
            self.loop = EngineLoop(self.engine).start()
            self.outboxes = Outboxes(self.loop.abort)
            self.loop.on_dispatched.append(self.outboxes.flush)
            self.spans = WorkerSpans(worker_id, self.role, provider_from_env("tandem-worker"))
            self.loop.on_outputs.append(self.spans.on_outputs)
            self.ledger: CoreLedger | None = None
        else:
            self.engine, self.loop, self.outboxes, self.spans = core.engine, core.loop, core.outboxes, core.spans
            self.ledger = core.ledger
            self.loop.call(lambda e: switch_role(e, config))
            self.spans.role = self.role
        self._last_stats: dict[str, Any] = {"worker_id": worker_id, "role": self.role, "pid": os.getpid()}
        self.draining = False
        self._calls = 0
        self._calls_lock = threading.Lock()
        self._last_call_end = float("-inf")
        self.load_s = time.monotonic() - t
        log.info("worker %s (%s) on %s", worker_id, self.role, device_label(self.engine.cache.device))
        if (nice := os.getpriority(os.PRIO_PROCESS, 0)) > 0:
            log.warning("worker %s runs at nice %d (Ray's default for its workers: start Ray with "
                        "RAY_worker_niceness=0): a busy process at nice 0 on this host takes its cores first",
                        worker_id, nice)  # fmt: skip

    def ping(self) -> str:
        return self.worker_id

    def share_cores(self, path: Path) -> None:
        """Lend this worker's threads to the other workers of its host while it is idle, and
        borrow theirs while they are (engine/core_ledger.py; the ledger file at `path`). A ledger
        that cannot be opened (no writable /dev/shm, every slot taken) leaves the worker on its
        own threads, logged: lending is worth no worker."""
        try:
            self.ledger = CoreLedger(path, self.config.num_threads or torch.get_num_threads())
        except (OSError, RuntimeError) as e:
            log.warning("worker %s steps on its own threads only: core ledger %s: %s", self.worker_id, path, e)
            return
        self.loop.cores = self.ledger

    def drain(self) -> None:
        """Stop taking new requests; in-flight ones run to completion."""
        self.draining = True

    def _check_open(self) -> None:
        if self.draining:
            raise WorkerDraining(f"worker {self.worker_id} is draining")

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Count a request-serving call (a generate, a prefill) from its start until it returns,
        so that `idle()` is False while one runs, even after the engine is done with it."""
        with self._calls_lock:
            self._calls += 1
        try:
            yield
        finally:
            with self._calls_lock:
                self._calls -= 1
                self._last_call_end = time.monotonic()

    def idle(self) -> bool:
        """True when nothing is in flight: no serving call for IDLE_SETTLE_S, no stream, no engine
        work, and every output taken by its router (a drain that ended on a request's last step,
        its last tokens still in the outbox, would lose them with the worker)."""
        with self._calls_lock:
            if self._calls or time.monotonic() - self._last_call_end < IDLE_SETTLE_S:
                return False
        if not self.loop.call(lambda e: not e.has_unfinished()) or self.loop.num_streams:
            return False
        return self.outboxes.undelivered == 0

    def abort(self, request_id: str) -> bool:
        self.spans.end(request_id, {"tandem.finish_reason": "abort"})
        return self.loop.abort(request_id)

    def _run_whole(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, step_timeout_s: float
    ) -> Iterator[TokenOutput]:
        """Prefill (what the prefix cache lacks) and decode `prompt_ids` in this engine, yielding
        outputs until the request finishes; closing the generator early aborts the request."""
        self._check_open()
        self.engine.prepare(params)
        stream = self.loop.open(request_id, lambda: self.engine.add_request(request_id, list(prompt_ids), params))
        try:
            for out in stream.iterate(step_timeout_s):
                yield TokenOutput.of(out)
        finally:
            self.loop.abort(request_id)  # no-op once finished; frees blocks if the caller went away

    def start(
        self,
        subscriber: str,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        traceparent: str | None = None,
    ) -> None:
        """`_run_whole`, its outputs going to `subscriber`'s outbox (`take_outputs`); returns once
        the request is queued. `traceparent`: the router's span, to record this worker's under
        (engine/spans.py). Raises InvalidRequestError, WorkerDraining."""
        self._check_open()
        self.engine.prepare(params)
        self.spans.begin(request_id, "worker.run", traceparent, {"tandem.prompt_tokens": len(prompt_ids)})
        self._open_into(
            subscriber, request_id, lambda: self.engine.add_request(request_id, list(prompt_ids), params, whole=True)
        )

    def _open_into(self, subscriber: str, request_id: str, add: Callable[[], Any]) -> None:
        """Open `request_id`'s stream into `subscriber`'s outbox; a failure ends its span."""
        sink = self.outboxes.sink(subscriber, request_id)
        try:
            self.loop.open_into(sink, request_id, add)
        except BaseException as e:
            self.outboxes.discard(sink)
            self.spans.end(request_id, error=f"{type(e).__name__}: {e}")
            raise

    def take_outputs(self, subscriber: str, wait_s: float) -> list[Item]:
        """The outputs of `subscriber`'s requests since its last take (engine/outbox.py): waits up
        to `wait_s` for a first one."""
        return self.outboxes.take(subscriber, wait_s)

    def pop_block_events(self) -> tuple[list[int], list[int]]:
        """Block hashes cached and evicted in the engine since the last call (for the prefix index)."""
        events: tuple[list[int], list[int]] = self.loop.call(lambda e: e.kv.pool.pop_events())
        return events

    def stats(self) -> dict[str, Any]:
        """Load and KV figures, read under the engine lock when it comes within STATS_WAIT_S;
        otherwise (a long prefill step holds it) the last figures read, marked `stale`. A
        heartbeat never waits out a step: a worker busy for seconds is busy, not gone."""
        live = {"role": self.role, "draining": self.draining, "steps": self.loop.steps, "load_s": self.load_s,
                "lent_steps": self.ledger.lent_steps if self.ledger is not None else 0}  # fmt: skip
        if not self.loop.lock.acquire(timeout=STATS_WAIT_S):
            return {**self._last_stats, **live, "stale": True}
        try:
            e = self.engine
            self._last_stats = {
                "worker_id": self.worker_id,
                "role": self.role,
                "pid": os.getpid(),
                "running": len(e.scheduler.running),
                "waiting": e.scheduler.num_waiting,
                "free_blocks": e.kv.num_free_blocks,
                "num_blocks": e.config.num_blocks,
                "kv_usage": e.kv.usage,
                "num_preemptions": e.scheduler.num_preemptions,
                "device": device_label(e.cache.device),
                **(e.speculator.stats() if e.speculator is not None else {}),
            }
        finally:
            self.loop.lock.release()
        return {**self._last_stats, **live}

    def check_integrity(self) -> None:
        self.loop.check_integrity()
        self.outboxes.check_integrity(self.loop.streaming())
        if self.ledger is not None:
            self.ledger.check_integrity()

    def close_role(self) -> None:
        """Close what only this role uses (servers, clients), keeping the engine and its loop."""

    def shutdown(self) -> None:
        self.close_role()
        self.outboxes.close()
        self.loop.stop()
        if self.ledger is not None:
            self.ledger.close()

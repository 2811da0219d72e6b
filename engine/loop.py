"""EngineLoop: one thread drives an Engine; any thread submits, aborts and reads streams.

The engine is not thread-safe. Everything that touches it takes `lock` (a FairRLock that
the KV receiver shares); the loop holds it for one step at a time and, the lock being fair,
queues behind any caller already waiting: an abort or a submission waits one step at most.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from engine.engine import Engine
from engine.errors import EngineError, StreamError
from engine.fair_lock import FairRLock
from engine.outputs import RequestOutput
from engine.torch_threads import set_team_size

log = logging.getLogger(__name__)


# How often a loop whose waiting requests need blocks held outside its running ones (a prefill's
# hand-offs until their transfer ends, a decode worker's reservations) looks again: it stepped
# at nothing at every turn, a core's worth, while what would free them needed the CPU.
BLOCKED_POLL_S = 0.002


class RequestStream:
    """Outputs of one request, in order, ending with a finished output or an error."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._q: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        self.first_output_time: float | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.first_output_time is None:
            self.first_output_time = time.monotonic()
        self._q.put(item)

    def get(self, timeout: float) -> RequestOutput:
        """The next output. Raises TimeoutError, or the error that ended the request."""
        try:
            item = self._q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output for {self.request_id!r} within {timeout:.1f} s") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def iterate(self, timeout: float) -> Iterator[RequestOutput]:
        """Outputs until the finished one; each wait bounded by `timeout`."""
        while True:
            out = self.get(timeout)
            yield out
            if out.finished:
                return


class OutputSink(Protocol):
    """Where a request's outputs go: a RequestStream (read by one caller), or an outbox's Sink."""

    def put(self, item: RequestOutput | BaseException) -> None: ...


class CoreShare(Protocol):
    """How many threads each step may use, shared with the host's other workers
    (engine/core_ledger.py): `claim()` before a step, `release()` before waiting for work."""

    def claim(self) -> int: ...

    def release(self) -> None: ...


class EngineLoop:
    def __init__(self, engine: Engine, lock: FairRLock | None = None) -> None:
        self.engine = engine
        self.cores: CoreShare | None = None
        self.lock = lock or FairRLock()
        self.steps = 0
        self._streams: dict[str, OutputSink] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.on_outputs: list[Callable[[list[RequestOutput]], None]] = []
        self.on_dispatched: list[Callable[[], None]] = []  # after each step's outputs are all put
        self._later: deque[Callable[[Engine], Any]] = deque()  # `later` calls, run before the next step

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def open(self, request_id: str, add: Callable[[], Any]) -> RequestStream:
        """Register a stream, then call `add()` (which adds the request to the engine) under the lock.

        Errors from `add` (invalid input, duplicate id) propagate and leave nothing behind."""
        stream = RequestStream(request_id)
        self.open_into(stream, request_id, add)
        return stream

    def open_into(self, stream: OutputSink, request_id: str, add: Callable[[], Any]) -> None:
        """`open`, with the outputs going to `stream`."""
        with self.lock:
            if request_id in self._streams:
                raise EngineError(f"request {request_id!r} is already streaming")
            self._streams[request_id] = stream
            try:
                add()
            except BaseException:
                self._streams.pop(request_id, None)
                raise
        self._wake.set()

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; its stream ends with a finished 'abort' output."""
        with self.lock:
            found = self.engine.abort(request_id)
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(RequestOutput(request_id, [], "", True, "abort"))
            self._flush()
        return found

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) under the lock (reserve, release, stats), after any `later` calls."""
        with self.lock:
            self._run_later()
            return fn(self.engine)

    def later(self, fn: Callable[[Engine], Any]) -> None:
        """Run fn(engine) under the lock before the next step (or the next `call`), without waiting
        for the step in progress: a prefill worker's release after a commit, which waited out the
        next request's whole prefill step (one of them at 1 thread: ~0.4 s) before the first token
        could go back. An exception is logged."""
        self._later.append(fn)
        self._wake.set()

    def _run_later(self) -> None:
        """Caller holds the lock."""
        while self._later:
            fn = self._later.popleft()
            try:
                fn(self.engine)
            except Exception:
                log.exception("a deferred engine call failed")

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def streaming(self) -> set[str]:
        """The ids of the requests whose outputs are being streamed."""
        return set(self._streams)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                self._run_later()
                busy = self.engine.has_unfinished()
                outs: list[RequestOutput] = []
                blocked = False
                if busy:
                    try:
                        self._size_team()
                        outs = self.engine.step()
                        self.steps += 1
                        blocked = not outs and not self.engine.scheduler.running
                    except Exception as e:  # outside any request's share (engine/containment.py): fail them all
                        log.exception("engine step failed")
                        self._fail_all(e)
            if outs:
                self._dispatch(outs)
            if blocked:  # what waits needs blocks that hand-offs or reservations hold: no spinning meanwhile
                self._wake.wait(BLOCKED_POLL_S)
                self._wake.clear()
            if not busy:
                if self.cores is not None:
                    self.cores.release()
                # Whatever gives the loop work sets _wake after it (open, later, stop), and the
                # next look for work follows the clear: no timeout, so an idle loop does not wake
                # (it polled 20 times a second, on the cores the engines use).
                self._wake.wait()
                self._wake.clear()

    def _size_team(self) -> None:
        """This step's OpenMP team: the threads the host's ledger lends it (on this thread: the
        team is the loop thread's)."""
        if self.cores is not None:
            n = self.cores.claim()
            if n != torch.get_num_threads():
                set_team_size(n)

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        for cb in self.on_outputs:
            cb(outs)
        for o in outs:
            stream = self._streams.get(o.request_id)
            if stream is None:
                continue
            stream.put(o if o.error is None else StreamError(o.error))
            if o.finished:
                self._streams.pop(o.request_id, None)
        self._flush()

    def _flush(self) -> None:
        for done in self.on_dispatched:
            done()

    def _fail_all(self, e: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            self.engine.abort(rid)
            stream.put(StreamError(f"engine step failed: {e}"))
        self._streams.clear()
        self._flush()

    def check_integrity(self) -> None:
        with self.lock:
            self._run_later()
            self.engine.check_integrity()

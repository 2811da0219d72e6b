"""One request's outputs across attempts: mid-stream failover by token replay, and cancel.

    attempt 1 on (p1, d1):  t0 t1 t2 t3 ── d1 dies / freezes
    attempt 2 on (p?, d2):  prompt + [t0..t3] as the prompt, max_tokens - 4, output_offset 4
                            ─▶ t4 t5 ... (the same tokens an uninterrupted run gives: greedy is
                               greedy, and a seeded sample i is drawn from (seed, i) anywhere)

The client's stream simply continues: no token twice or missing, `usage` counts the original
prompt and every output token. A failure before any token reaches the caller is raised as
WorkerDiedError (the router retries it on another pair); after `max_migrations` replays the
request ends with a clean WorkerDiedError.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator
from dataclasses import replace

from cluster.handoff import Attempt
from cluster.liveness import AttemptFailed, EngineFault
from cluster.outputs import StreamOutput
from cluster.routing import Route
from engine.errors import EngineError
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class WorkerDiedError(EngineError):
    """A worker died (or froze) while serving the request, and it could not be moved. `suspect`:
    the worker that failed, when that is known (a retry avoids it first)."""

    def __init__(self, message: str, suspect: str | None = None) -> None:
        super().__init__(message)
        self.suspect = suspect


class EngineFailedError(WorkerDiedError):
    """The engine failed on the request (engine/containment.py) where it last ran, its worker alive:
    a bug the request sets off, or a fault of that moment (the server log has its traceback)."""


StartAttempt = Callable[[str, list[int], SamplingParams, Route, threading.Event], Attempt]
Reroute = Callable[[list[int], SamplingParams, frozenset[str]], Route]


class RequestRun:
    """An iterator of StreamOutputs, with `cancel()` from any thread.

    The first output carries the first attempt's Placement; the finished one the number of
    migrations. `close()` ends the run and frees its workers."""

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        route: Route,
        start: StartAttempt,
        reroute: Reroute,
        max_migrations: int = 2,
    ) -> None:
        self.request_id = request_id
        self.migrations = 0
        self._cancel = threading.Event()
        self._gen = self._run(prompt, params, route, start, reroute, max_migrations)

    def __iter__(self) -> RequestRun:
        return self

    def __next__(self) -> StreamOutput:
        return next(self._gen)

    def cancel(self) -> None:
        """Stop waiting at once (thread-safe): the run raises Cancelled from its current wait."""
        self._cancel.set()

    def close(self) -> None:
        self._cancel.set()
        self._gen.close()

    def _run(
        self,
        prompt: list[int],
        params: SamplingParams,
        route: Route,
        start: StartAttempt,
        reroute: Reroute,
        max_migrations: int,
    ) -> Generator[StreamOutput, None, None]:
        emitted: list[int] = []
        attempt_id = self.request_id
        while True:
            sub = _after(params, len(emitted))
            attempt = start(attempt_id, prompt + emitted, sub, route, self._cancel)
            earlier = len(emitted)
            try:
                for out in attempt.run():
                    placement = attempt.placement if not emitted else None
                    migrations = self.migrations if out.finished else 0
                    emitted += out.token_ids
                    yield StreamOutput.of_token(out.shifted(len(prompt), earlier), placement, migrations)
                return
            except AttemptFailed as e:
                if not emitted:
                    raise _failed(e, f"the request failed before its first token: {e}", e.suspect) from None
                if self.migrations >= max_migrations:
                    after = f"the request failed after {self.migrations} migration(s): {e}"
                    raise _failed(e, after, e.suspect) from None
                route = self._reroute(reroute, prompt + emitted, _after(params, len(emitted)), route, e)
                self.migrations += 1
                attempt_id = f"{self.request_id}.m{self.migrations}"
                log.warning("request %s: %s after %d tokens; replaying on %s", self.request_id, e, len(emitted), route)
            finally:
                attempt.close()

    @staticmethod
    def _reroute(reroute: Reroute, prompt: list[int], params: SamplingParams, failed: Route, e: AttemptFailed) -> Route:
        exclude = frozenset({e.suspect}) if e.suspect else frozenset({failed.decode})
        try:
            return reroute(prompt, params, exclude)
        except EngineError as no_route:
            raise _failed(e, f"{e}; no other worker to continue on ({no_route})") from None


def _failed(e: AttemptFailed, message: str, suspect: str | None = None) -> WorkerDiedError:
    """The request's end after attempt failure `e`: EngineFailedError where its engine failed on
    it (a bug, likely met again elsewhere), else WorkerDiedError."""
    return (EngineFailedError if isinstance(e, EngineFault) else WorkerDiedError)(message, suspect)


def _after(params: SamplingParams, emitted: int) -> SamplingParams:
    """`params` for a replay whose prompt carries the `emitted` tokens already sent (and the
    prompt's logprobs, which came with the first)."""
    if not emitted:
        return params
    return replace(params, max_tokens=params.max_tokens - emitted, output_offset=params.output_offset + emitted,
                   prompt_logprobs=None)  # fmt: skip

"""Failover by replay (cluster.request_run) and the request path's view (cluster.view), with
fakes only at their declared boundaries: the StartAttempt / Reroute callables, the readers."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from cluster.liveness import AttemptFailed, EngineFault
from cluster.outputs import Placement
from cluster.request_run import EngineFailedError, RequestRun, WorkerDiedError
from cluster.routing import Route
from cluster.view import ViewRefresher
from engine.messages import TokenOutput
from engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0.7, seed=3)


@dataclass
class FakeAttempt:
    """Emits `tokens` one at a time (output counts as a worker would), then fails if `fail_after`."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    route: Route
    tokens: list[int]
    fail_after: int | None = None
    fault: type[AttemptFailed] = AttemptFailed
    placement: Placement | None = None
    closed: bool = False

    def run(self) -> Iterator[TokenOutput]:
        self.placement = Placement(str(self.route.prefill), self.route.decode)
        n = len(self.tokens) if self.fail_after is None else self.fail_after
        for i, t in enumerate(self.tokens[:n]):
            done = self.fail_after is None and i == len(self.tokens) - 1
            yield TokenOutput((t,), f"<{t}>", done, "length" if done else None, len(self.prompt), i + 1)
        if self.fail_after is not None:
            raise self.fault(f"{self.route.decode} failed", self.route.decode)

    def close(self) -> None:
        self.closed = True


class Script:
    """Hands out FakeAttempts: the whole answer is 10..15; attempt k fails after fails[k] tokens."""

    def __init__(self, fails: list[int | None], fault: type[AttemptFailed] = AttemptFailed) -> None:
        self.fails = fails
        self.fault = fault
        self.attempts: list[FakeAttempt] = []
        self.reroutes: list[tuple[list[int], SamplingParams, frozenset[str]]] = []

    def start(self, rid: str, prompt: list[int], params: SamplingParams, route: Route, cancel: threading.Event):  # type: ignore[no-untyped-def]
        done = len(prompt) - 2  # the prompt is [1, 2] + what was emitted so far
        a = FakeAttempt(
            rid, prompt, params, route, list(range(10 + done, 16)), self.fails[len(self.attempts)], self.fault
        )
        self.attempts.append(a)
        return a

    def reroute(self, prompt: list[int], params: SamplingParams, exclude: frozenset[str]) -> Route:
        self.reroutes.append((prompt, params, exclude))
        return Route(decode=f"d{len(self.reroutes) + 1}", prefill="p1")


def test_a_dead_decode_worker_mid_stream_is_replayed_without_a_gap() -> None:
    s = Script([2, None])
    outs = list(RequestRun("r", [1, 2], PARAMS, Route("d1", "p1"), s.start, s.reroute))  # type: ignore[arg-type]
    assert [t for o in outs for t in o.token_ids] == [10, 11, 12, 13, 14, 15]
    assert [o.num_output_tokens for o in outs] == [1, 2, 3, 4, 5, 6]
    assert {o.num_prompt_tokens for o in outs} == {2}
    assert outs[0].placement == Placement("p1", "d1") and outs[2].placement is None
    assert outs[-1].finished and outs[-1].migrations == 1 and outs[0].migrations == 0
    ((prompt, params, exclude),) = s.reroutes
    assert prompt == [1, 2, 10, 11] and exclude == {"d1"} and params.max_tokens == 4
    second = s.attempts[1]
    assert second.request_id == "r.m1" and second.prompt == [1, 2, 10, 11]
    assert (second.params.max_tokens, second.params.output_offset, second.params.seed) == (4, 2, 3)
    assert all(a.closed for a in s.attempts)


def test_migrations_are_bounded() -> None:
    s = Script([1, 1, 1])
    run = RequestRun("r", [1, 2], PARAMS, Route("d1", "p1"), s.start, s.reroute, max_migrations=2)  # type: ignore[arg-type]
    got = []
    with pytest.raises(WorkerDiedError, match="after 2 migration"):
        for o in run:
            got += o.token_ids
    assert got == [10, 11, 12] and all(a.closed for a in s.attempts)


def test_a_failure_before_any_token_is_left_to_the_router() -> None:
    s = Script([0])
    with pytest.raises(WorkerDiedError, match="before its first token"):
        list(RequestRun("r", [1, 2], PARAMS, Route("d1", "p1"), s.start, s.reroute))  # type: ignore[arg-type]
    assert s.reroutes == [] and s.attempts[0].closed


def test_no_other_worker_ends_cleanly() -> None:
    s = Script([2])

    def nowhere(prompt: list[int], params: SamplingParams, exclude: frozenset[str]) -> Route:
        from cluster.cluster import NoWorkerError

        raise NoWorkerError("no decode worker has room")

    with pytest.raises(WorkerDiedError, match="no other worker"):
        list(RequestRun("r", [1, 2], PARAMS, Route("d1", "p1"), s.start, nowhere))  # type: ignore[arg-type]


@pytest.mark.parametrize("fails", [[0], [1, 1, 1]], ids=["before-its-first-token", "after-its-migrations"])
def test_an_engine_that_fails_on_the_request_is_told_from_a_dead_worker(fails: list[int | None]) -> None:
    """A worker's engine that failed on the request (engine/containment.py) is replayed like a
    dead worker, and ends as EngineFailedError: the router answers 500, not "a worker stopped"."""
    s = Script(fails, EngineFault)
    with pytest.raises(EngineFailedError, match="d1 failed" if fails == [0] else "after 2 migration") as e:
        list(RequestRun("r", [1, 2], PARAMS, Route("d1", "p1"), s.start, s.reroute))  # type: ignore[arg-type]
    assert e.value.suspect == s.attempts[-1].route.decode and len(s.attempts) == len(fails)
    with pytest.raises(WorkerDiedError) as died:
        list(RequestRun("r", [1, 2], PARAMS, Route("d1", "p1"), Script(fails).start, s.reroute))  # type: ignore[arg-type]
    assert type(died.value) is WorkerDiedError


def test_view_keeps_the_last_known_state_when_a_source_fails() -> None:
    registry: dict[str, dict[str, object]] = {"d1": {"role": "decode"}, "p1": {"role": "prefill"}}
    handles: dict[str, object] = {"d1": object(), "p1": object()}
    broken = {"redis": False, "manager": False}
    seen = []

    def read_registry() -> dict[str, dict[str, object]]:
        if broken["redis"]:
            raise ConnectionError("redis is down")
        return dict(registry)

    def read_handles() -> dict[str, object]:
        if broken["manager"]:
            raise TimeoutError("the pool manager is slow")
        return dict(handles)

    v = ViewRefresher(read_registry, read_handles, on_refresh=seen.append)
    first = v.refresh()
    assert set(first.live()) == {"d1", "p1"} and first.state_ok and seen == [first]
    broken["redis"] = True
    del registry["p1"]
    second = v.refresh()
    assert set(second.live()) == {"d1", "p1"} and not second.state_ok  # routing goes on from the last registry
    broken["redis"], broken["manager"] = False, True
    third = v.refresh()
    assert set(third.live()) == {"d1"} and third.state_ok and seen == [first, second]  # no reconcile on stale handles
    assert v.current() is third


def test_view_reads_the_pool_manager_only_when_the_registry_moves() -> None:
    registry: dict[str, dict[str, object]] = {"d1": {"role": "decode"}, "p1": {"role": "prefill"}}
    handles: dict[str, object] = {"d1": object(), "p1": object()}
    reads, seen = [], []
    broken = {"manager": False}

    def read_handles() -> dict[str, object]:
        reads.append(1)
        if broken["manager"]:
            raise TimeoutError("the pool manager is slow")
        return dict(handles)

    v = ViewRefresher(lambda: {w: dict(i) for w, i in registry.items()}, read_handles, on_refresh=seen.append,
                      full_s=3600.0)  # fmt: skip

    def background() -> int:
        """One refresh of the background loop; the pool manager reads so far."""
        v.refresh(force=False)
        return len(reads)

    v.refresh()
    assert [background() for _ in range(3)] == [1, 1, 1] and len(seen) == 1  # nothing moved: no call
    registry["d2"] = {"role": "decode"}  # a new worker registered; the manager has not promoted it yet
    assert [background(), background()] == [2, 3] and "d2" not in v.current().live()
    handles["d2"] = object()
    assert [background(), background()] == [4, 4] and set(v.current().live()) == {"d1", "d2", "p1"}
    registry["d1"]["draining"] = True  # its heartbeat says it drains: the manager has taken it out
    del handles["d1"]
    assert [background(), background()] == [5, 5] and set(v.current().live()) == {"d2", "p1"}
    del registry["p1"]  # removed (deregistered) by the manager
    del handles["p1"]
    assert [background(), background()] == [6, 6] and set(v.current().live()) == {"d2"}
    assert len(seen) == len(reads) == 6  # the ledger reconciles after each read, and only then
    broken["manager"] = True
    registry["p2"] = {"role": "prefill"}
    assert background() == 7 and "p2" not in v.current().live()
    broken["manager"] = False
    handles["p2"] = object()
    assert background() == 8 and set(v.current().live()) == {"d2", "p2"}  # a failed read is due again
    v.full_s = 0.0
    assert [background(), background()] == [9, 10]  # and every full_s whatever the registry says
    v.refresh()
    assert len(reads) == 11  # an explicit refresh always reads


class RecordingHandle:
    """An actor handle whose methods' .remote() calls are recorded."""

    def __init__(self, name: str, calls: list[tuple[str, str]]) -> None:
        self.name, self.calls = name, calls

    def __getattr__(self, method: str) -> SimpleNamespace:
        return SimpleNamespace(remote=lambda *args: self.calls.append((self.name, method)))


def test_an_attempt_closed_after_ray_is_gone_calls_no_worker() -> None:
    """A stream dropped after Cluster.shutdown is closed wherever the collector finds it: a
    remote call there would start a new Ray (auto-init) and hang. Its ledger entry still ends."""
    import ray

    from cluster.handoff import Attempt, Seam, Stage
    from cluster.inflight import InflightLedger

    assert not ray.is_initialized()
    calls: list[tuple[str, str]] = []
    ledger = InflightLedger()
    ledger.begin("r", "d", "p", 1, 3)
    handles = {w: RecordingHandle(w, calls) for w in ("d", "p")}
    attempt = Attempt("r", [1, 2, 3], PARAMS, Route("d", "p"), handles, Seam(ledger, None, None), threading.Event())  # type: ignore[arg-type]
    attempt.close()
    assert calls == [] and attempt.stage is Stage.FAILED and len(ledger) == 0
    ledger.check_integrity()

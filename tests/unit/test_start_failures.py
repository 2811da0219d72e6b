"""cluster/start_failures.py: a role's failed starts in a row, its backoff, and the one-line
reason Ray's error text carries; pool_plan's name for a worker that died before answering; and
Ray's own start, tried once more after its GCS port wait timed out."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cluster.config import start_ray
from cluster.pool_plan import Limits, Removal, WorkerHealth, decide
from cluster.start_failures import BACKOFF_S, StartFailures, WorkersCannotStart, death_reason
from router.admin import pools

RAY_TEXT = """The actor died because of an error raised in its creation task, ray::tandem-x-p1-1:PDActor.__init__() \
(pid=1, ip=127.0.0.1, actor_id=ab)
  File "/work/main/engine/engine.py", line 55, in __init__
    model.prefill_attention = pick_prefill_attention(
ValueError: prefill_attention 'int8' is not available (no C library here): use auto or torch"""


class RayLikeError(Exception):
    pass


def test_starts_back_off_after_failures_in_a_row_and_a_worker_up_clears_them() -> None:
    f = StartFailures()
    assert f.may_start("decode", 0.0) and f.snapshot() == ()
    first = f.failed("decode", "ValueError: no", 10.0)
    assert first.count == 1 and first.backoff_s() == BACKOFF_S[0]
    assert not f.may_start("decode", 10.5) and f.may_start("decode", 11.0)
    assert f.may_start("prefill", 10.5)  # per role
    for n in range(2, 10):
        last = f.failed("decode", "ValueError: no", 100.0 * n)
        assert last.count == n and last.backoff_s() == BACKOFF_S[min(n, len(BACKOFF_S)) - 1]
    assert not f.may_start("decode", 900.0 + BACKOFF_S[-1] - 0.1) and f.may_start("decode", 900.0 + BACKOFF_S[-1])
    assert [s.role for s in f.snapshot()] == ["decode"]
    f.came_up("decode")
    assert f.snapshot() == () and f.may_start("decode", 0.0)


def test_the_reason_is_the_innermost_exception_in_rays_text() -> None:
    reason = death_reason(RayLikeError(RAY_TEXT))
    assert reason == "ValueError: prefill_attention 'int8' is not available (no C library here): use auto or torch"
    # Ray's own wrappers are not the reason; a text without an exception line gives its first line
    assert death_reason(RayLikeError("ray.exceptions.ActorDiedError: The actor died unexpectedly")).startswith(
        "RayLikeError: ray.exceptions.ActorDiedError"
    )
    assert death_reason(RayLikeError("")) == "RayLikeError: "
    assert len(death_reason(RayLikeError("x" * 2000))) == 500
    err = WorkersCannotStart("decode", 2, reason)
    assert str(err) == f"decode workers fail to start (2 in a row): {reason}" and err.role == "decode"


def test_a_worker_dead_before_its_first_answer_failed_to_start() -> None:
    never = WorkerHealth("d0", "decode", "starting", 3.0, None, dead=True)
    answered = WorkerHealth("d1", "decode", "up", 50.0, 0.5, dead=True)
    plan = decide([never, answered], {"decode": 2}, Limits())
    assert plan.remove == (Removal("d0", "failed to start"), Removal("d1", "died"))
    assert plan.start == ("decode", "decode")  # the pool manager holds them back while its role backs off


def test_admin_pools_shows_the_roles_that_cannot_start_and_why() -> None:
    failing = [{"role": "decode", "count": 3, "reason": "ValueError: not a GGUF v2/v3 file"}]
    view = pools({"desired": {"decode": 1}, "workers": [], "start_failures": failing})
    assert view["start_failures"] == failing and view["up"]["decode"] == 0
    assert pools({"desired": {}, "workers": []})["start_failures"] == []  # a status from before them


def test_ray_is_started_once_more_after_its_gcs_port_wait_timed_out() -> None:
    """cluster.config.start_ray: the GCS port file's timeout is retried once (after a shutdown of
    what the failed start left); another error, or the same one twice, is raised."""
    calls: list[str] = []

    def init_failing(times: int, message: str) -> Callable[..., None]:
        def init(**kwargs: object) -> None:
            calls.append(f"init {sorted(kwargs)}")
            if sum(c.startswith("init") for c in calls) <= times:
                raise RuntimeError(message)

        return init

    timed_out = "Timed out waiting for file /tmp/ray/session_x/gcs_server_port_abc"
    start_ray(init_failing(1, timed_out), lambda: calls.append("shutdown"), log_to_driver=False)
    assert calls == ["init ['log_to_driver']", "shutdown", "init ['log_to_driver']"]
    calls.clear()
    with pytest.raises(RuntimeError, match="Timed out"):
        start_ray(init_failing(2, timed_out), lambda: calls.append("shutdown"))
    assert calls == ["init []", "shutdown", "init []"]
    calls.clear()
    with pytest.raises(RuntimeError, match="address in use"):
        start_ray(init_failing(1, "address in use"), lambda: calls.append("shutdown"))
    assert calls == ["init []"]

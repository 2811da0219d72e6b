"""Stopping what a Cluster started, in order, each step bounded.

A step that calls Ray blocks for as long as Ray's client retries: with the raylet and the GCS
gone (SIGTERM to a whole process group, as `systemctl stop` sends it, or a `ray stop` first),
listing the named actors waited until the GCS client gave up after 60 s and the process died
with a fatal error. So every step runs on a thread of its own, waited for up to its bound; a
Ray step that does not return in time is left behind, and the Ray steps after it are skipped
(Ray does not answer: there is nothing left to stop through it). A caller that already knows
Ray is gone (a joined cluster brought down: router.ray_watch) skips them all; one that can tell
whether Ray is down now (`ray_down`: its GCS refuses connections) has a Ray step skipped once it
is, and a Ray step's wait cut short when it goes meanwhile (a whole process group SIGTERMed, Ray's
GCS dying beside the caller), rather than waited out to its bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

RAY_STEP_S = 10.0  # a control call to a live Ray answers in milliseconds; 10 s is "not answering"
LOOK_S = 0.25  # how often a Ray step's wait asks `ray_down`


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[], object]
    bound_s: float = RAY_STEP_S
    ray: bool = False  # skipped once a Ray step has not answered within its bound
    # ray.shutdown of a Ray this process started: it stops the GCS itself, so the GCS refusing
    # while it runs is no sign that it hangs (its wait is not cut short by `ray_down`)
    stops_ray: bool = False


@dataclass(frozen=True)
class Outcome:
    done: tuple[str, ...]  # returned (or raised: logged) within the bound
    left_behind: tuple[str, ...]  # still running on their threads after their bounds
    skipped: tuple[str, ...]  # Ray steps not started: Ray had stopped answering
    ray_answered: bool  # no Ray step was left behind


def run_steps(steps: list[Step], ray_gone: bool = False, ray_down: Callable[[], bool] = lambda: False) -> Outcome:
    """Run `steps` in order, each on a daemon thread waited for up to its bound. A failing step
    is logged and the next one runs; see the module's docstring for Ray steps (`ray_gone`:
    skip them from the first; `ray_down`: whether Ray is gone now)."""
    done: list[str] = []
    left: list[str] = []
    skipped: list[str] = []
    for step in steps:
        ray_gone = ray_gone or (step.ray and ray_down())
        if step.ray and ray_gone:
            skipped.append(step.name)
            continue
        ended = _bounded(step, ray_down if step.ray and not step.stops_ray else lambda: False)
        if ended == "returned":
            done.append(step.name)
            continue
        if ended == "ray down":
            log.warning("shutdown: %s left behind: Ray's GCS refuses connections now", step.name)
        else:
            log.warning("shutdown: %s did not return within %.0f s; going on without it", step.name, step.bound_s)
        left.append(step.name)
        ray_gone = ray_gone or step.ray
    return Outcome(tuple(done), tuple(left), tuple(skipped), ray_answered=not ray_gone)


def _bounded(step: Step, ray_down: Callable[[], bool]) -> Literal["returned", "bound", "ray down"]:
    finished = threading.Event()

    def run() -> None:
        start = time.monotonic()
        try:
            step.run()
        except Exception as e:
            log.warning("shutdown step %s failed after %.1f s: %s", step.name, time.monotonic() - start, e)
        finally:
            finished.set()

    threading.Thread(target=run, name=f"shutdown-{step.name}", daemon=True).start()
    end = time.monotonic() + step.bound_s
    while not finished.wait(max(0.0, min(LOOK_S, end - time.monotonic()))):
        if time.monotonic() >= end:
            return "bound"
        if ray_down():
            return "ray down"
    return "returned"

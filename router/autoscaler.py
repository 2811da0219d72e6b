"""The autoscaler (opt-in: `tandem serve --autoscale`): every interval it takes the router's
window (router.window), plans pool sizes for that traffic with the simulator when it has a
profile (planner.search), lets the policy (planner.autoscale.decide) move the desired sizes
toward the plan within the operator's bounds, and records the decision, with its reasons, as a
cluster event (`GET /admin/events`). The pool manager then starts or drains workers as it does
for `/admin/pools`.

It runs on its own thread in the router's process and calls the backend like the admin API does;
no lock is held across those calls. With several routers, one decides over all their windows
(router/window_share.py); the others publish theirs.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Mapping

from engine.roles import ROLES
from planner.autoscale import Decision, Host, Memory, Window, decide
from planner.search import Handoff, NodeKind, fewest_colocated, size_pair
from planner.slo import SLO
from planner.trace import Trace
from router.autoscale_flags import AutoscaleConfig, profile_paths
from router.backend import Backend
from router.window import LoadWindow, Taken
from router.window_share import WindowShare, merged

log = logging.getLogger("tandem.autoscaler")

# the sizes meeting the SLOs for a trace, given the current ones (P/D or colocated); None: no answer
Planner = Callable[[Trace, SLO, Mapping[str, int]], dict[str, int] | None]


def window_trace(taken: Taken) -> Trace | None:
    """The window's finished requests as a trace (by arrival), or None with fewer than two."""
    ok = sorted((s for s in taken.samples if math.isfinite(s.ttft_s)), key=lambda s: s.arrival)
    if len(ok) < 2:
        return None
    t0 = ok[0].arrival
    return Trace.of([(s.arrival - t0, max(1, s.prompt), 0, max(1, s.output), "") for s in ok])


def profile_planner(kind: NodeKind, handoff: Handoff, limit: int = 64) -> Planner:
    """Sizes from the simulator over one node kind's profile: the fewest colocated workers, or
    the fewest prefill and decode workers, meeting the SLOs (at most `kind.available` in all)."""

    def plan(trace: Trace, slo: SLO, current: Mapping[str, int]) -> dict[str, int] | None:
        if current.get("colocated", 0) and not current.get("prefill", 0):
            n = fewest_colocated(kind, trace, slo, kind.available or limit)
            return None if n is None else {"prefill": 0, "decode": 0, "colocated": n}
        sized = size_pair(kind, kind, trace, slo, handoff, limit)
        return None if sized is None else {"prefill": sized[0], "decode": sized[1], "colocated": 0}

    return plan


class Autoscaler:
    def __init__(
        self,
        backend: Backend,
        window: LoadWindow,
        config: AutoscaleConfig,
        planner: Planner | None = None,
        clock: Callable[[], float] = time.monotonic,
        share: WindowShare | None = None,
    ) -> None:
        self.backend, self.window, self.config, self.planner, self.clock = backend, window, config, planner, clock
        self.share = share
        self.memory = Memory()

    def tick(self) -> Decision | None:
        """One decision: take the window, plan, decide, scale, record the event. With a share:
        None while another router decides (this one's window goes to it)."""
        taken = self.window.take()
        if self.share is not None:
            if not self.share.lead():
                self.share.publish(taken)
                return None
            taken = merged(taken, self.share.collect())
            last = self.share.last_change()  # another router's, if it led before this one
            if last is not None and (self.memory.last_change_s is None or last.at_s > self.memory.last_change_s):
                self.memory = Memory(last.at_s, self.memory.lower_in_a_row, last.flipped_to)
        status = self.backend.status()
        desired = status.get("desired", {})
        current: dict[str, int] = {r: int(desired.get(r, 0)) for r in ROLES}
        workers = [w for w in status.get("workers", []) if w.get("state") == "up"]
        slo = self.config.slo
        n = len(taken.samples)
        window = Window(
            taken.seconds,
            taken.requests,
            sum(s.ttft_s <= slo.ttft_s for s in taken.samples) / n if n else 1.0,
            sum(s.tpot_s <= slo.tpot_s for s in taken.samples) / n if n else 1.0,
            sum(int(w.get("waiting", 0)) for w in workers),
            statistics.fmean(float(w.get("kv_usage", 0.0)) for w in workers) if workers else 0.0,
        )
        planned, unplanned = None, "no profile to plan with"
        trace = window_trace(taken) if self.planner is not None else None
        if self.planner is not None and trace is not None:
            planned = self.planner(trace.at_rate(self.config.headroom), slo, current)
            unplanned = "no size the planner can reach meets the SLO at this traffic"
        elif self.planner is not None:
            unplanned = "too few finished requests to plan over"
        decision, self.memory = decide(self.clock(), current, planned, window, self.config.bounds, self.memory,
                                       unplanned)  # fmt: skip
        if decision.changed:  # together: one pool down and the other up is a role flip, not a drain and a start
            self.backend.scale({r: decision.sizes[r] for r in ROLES if decision.sizes[r] != current[r]})
            if self.share is not None and self.memory.last_change_s is not None:
                self.share.changed(self.memory.last_change_s, self.memory.flipped_to)
        if decision.changed or decision.held:
            sizes = {r: decision.sizes[r] for r in ROLES}
            self.backend.emit("autoscale", changed=decision.changed, sizes=sizes, planned=planned,
                              reasons=list(decision.reasons))  # fmt: skip
            log.info("autoscale %s: %s", "changed" if decision.changed else "held", "; ".join(decision.reasons))
        return decision

    def run(self, stop: threading.Event) -> None:
        """Decide every interval until `stop` is set; a failed round is logged and skipped."""
        while not stop.wait(self.config.interval_s):
            try:
                self.tick()
            except Exception as e:
                log.warning("autoscale round failed: %r", e)


def planner_from_args(args: argparse.Namespace, config: AutoscaleConfig, host: Host | None) -> Planner | None:
    """The simulator's planner over `--autoscale-profile` (comma-separated `tandem profile`
    JSONs), on `host` where every worker shares this one (planner.kinds.host_kind); None
    without a profile. Raises ValueError where the profiles do not fit (before any start)."""
    if not args.autoscale_profile:
        return None
    from engine.model_files import default_model_path
    from planner.kinds import CPU_HANDOFF_FIXED_S, host_kind, model_config
    from planner.profile import EngineProfile
    from planner.roofline import ModelShape

    profiles = []
    for path in profile_paths(args.autoscale_profile):
        try:
            profiles.append(EngineProfile.load(path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a `tandem profile` JSON ({e})") from None
    kind = host_kind(profiles, host, max(config.bounds.max.values()))
    served = model_config(args.model or str(default_model_path()))
    shape = ModelShape.of(served, profiles[0].dtype, profiles[0].kv_dtype)  # one dtype: host_kind checked
    return profile_planner(kind, Handoff(CPU_HANDOFF_FIXED_S, shape.kv_bytes_per_token))


def start(config: AutoscaleConfig, backend: Backend, window: LoadWindow, stop: threading.Event,
          planner: Planner | None, share: WindowShare | None = None) -> Autoscaler:  # fmt: skip
    """Build the autoscaler for `tandem serve` and run it on a daemon thread until `stop`."""
    scaler = Autoscaler(backend, window, config, planner, share=share)
    threading.Thread(target=scaler.run, args=(stop,), name="autoscaler", daemon=True).start()
    return scaler

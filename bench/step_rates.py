"""The load step's rates, from the simulator: the one step whose outcome the autoscaler's flip
decides, on whatever machine runs it.

Fixed multiples of each mix's one-at-a-time rate are not portable: the SLO comes from the same
machine's probes, and how many requests three 1-thread workers hold within it differs from CPU to
CPU (on a Zen 4, 3x the decode-heavy rate overloaded 2P+1D and 1P+2D alike, so no policy could
recover; 1.5x was held by 2P+1D, so none had to). Here, with the 1-thread profile calibrated on
the static cluster's own probes (as `tandem bench planner` validates it), the simulator gives
the decode-heavy goodput of 2P+1D (the static sizes) and of 1P+2D (one worker flipped):

    before = BEFORE_SHARE x the prefill-heavy goodput of 2P+1D  (held: nothing should flip)
    after  = sqrt(decode-heavy goodput of 2P+1D x that of 1P+2D)  (missed unless one flips)

The geometric mean sits as far, in ratio, from each side, so a simulator error smaller than
half the flip's gain (in ratio) still leaves the step where it was meant to be."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.loadgen import arrivals
from bench.planner_bench import calibration, prompt_tokens, scaled_spec
from bench.sweep import Unloaded
from bench.workloads import Mix, make_items
from engine.config import ModelConfig
from engine.tokenizer import Tokenizer
from planner.kinds import CPU_HANDOFF_FIXED_S
from planner.profile import EngineProfile
from planner.roofline import ModelShape
from planner.search import Handoff, NodeKind, goodput
from planner.simulator import WorkerSpec
from planner.slo import SLO
from planner.step_costs import StepCosts
from planner.trace import Trace

BEFORE_SHARE = 0.5
TRACE_REQUESTS = 256  # enough that the trace's rate cap (planner.search.max_rate) is far above both goodputs
SEED = 7


@dataclass(frozen=True)
class StepRates:
    before_rps: float
    after_rps: float
    before_held_rps: float  # simulated goodput of the prefill-heavy mix on the static sizes
    after_static_rps: float  # of the decode-heavy mix on the static sizes
    after_flipped_rps: float  # and with one prefill worker flipped to decode

    @property
    def flip_gain(self) -> float:
        """How much more of the decode-heavy mix the flipped sizes hold (1: the flip buys nothing)."""
        return self.after_flipped_rps / self.after_static_rps if self.after_static_rps else math.inf


@dataclass(frozen=True)
class Sizes:
    prefill: int
    decode: int

    def flipped(self) -> Sizes:
        return Sizes(self.prefill - 1, self.decode + 1)


def step_rates(
    profile: EngineProfile,
    config: ModelConfig,
    kv_tokens: int,
    sizes: Sizes,
    mixes: tuple[Mix, Mix],
    probes: dict[str, Unloaded],
    probe_seed: int,
    probe_requests: int,
    slo: SLO,
    tok: Tokenizer,
) -> StepRates:
    """`mixes` (before, after); `probes` their unloaded latencies on the static cluster, sent by
    bench.sweep.probe with `probe_seed` and `probe_requests`; `slo` the step's one SLO."""
    gbps = profile.transfer_gbps.get("grpc", 1.0)
    worker = NodeKind(profile.node_class, WorkerSpec(StepCosts.fit(profile), kv_tokens), transfer_gbps=gbps)
    handoff = Handoff(CPU_HANDOFF_FIXED_S, ModelShape.of(config, profile.dtype, profile.kv_dtype).kv_bytes_per_token)

    def held(mix: Mix, s: Sizes) -> float:
        spec = handoff.spec(worker, s.prefill, worker, s.decode)
        unloaded = {mix.cls or mix.name: {"ttft_s": probes[mix.name].ttft_s, "tpot_s": probes[mix.name].tpot_s}}
        spec = scaled_spec(spec, *calibration(spec, mix, unloaded, probe_seed, probe_requests, tok))
        return goodput(spec, _trace(mix, tok), slo)

    before, after = mixes
    held_before = held(before, sizes)
    static, flipped = held(after, sizes), held(after, sizes.flipped())
    if not (held_before and flipped):
        raise RuntimeError(
            f"the simulator says {sizes} hold none of {before.name} ({held_before:.3g} req/s) or "
            f"{sizes.flipped()} none of {after.name} ({flipped:.3g} req/s) at {slo}: no step to take"
        )
    after_rps = math.sqrt(static * flipped) if static else flipped / 2
    return StepRates(BEFORE_SHARE * held_before, after_rps, held_before, static, flipped)


def _trace(mix: Mix, tok: Tokenizer) -> Trace:
    items = make_items(mix, TRACE_REQUESTS, seed=SEED, salt=SEED)
    at = arrivals(len(items), 1.0, "poisson", SEED)
    return Trace.of(
        [(a, p, 0, it.max_tokens, it.cls) for a, p, it in zip(at, prompt_tokens(tok, items), items, strict=True)]
    )

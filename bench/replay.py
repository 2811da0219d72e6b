"""The simulator's replay of a `tandem bench compare` result (`tandem bench planner`'s validation).

For each mix and system of a compare.json (colocated 1 worker x 2 threads, P/D 1P+1D
x 1 thread), each measured rate is replayed in the simulator on the very requests and
arrival times the sweep sent (bench.workloads.make_items and bench.loadgen.arrivals with
the sweep's seeds; prompts counted with the chat template), on the profile of a worker
with that many threads. Goodput = bench.stats.max_rate_meeting over those points, with
the measured per-class SLOs, as the compare computes it. Error = |simulated - measured|
/ measured. How much slower a worker runs in the cluster than the profile's engine
alone (the router, Ray and streaming on the same cores) is calibrated on the compare's
own unloaded probes: the probe requests run alone in the simulator; the measured median
TTFT over the simulated one scales the prefill costs (never below 1), and the measured
median TPOT less the simulated one is added to every decode step (never below 0): the
serving path's cost a step (outboxes, feeds, the router's tokens) does not grow with the
engine's work as a scale would have it (a scale put colocated 1x2t's decode-heavy goodput
at 0.72 req/s where 1.35 was measured). No loaded point is used to calibrate.

Workers of one system share its host: a worker busy alone there steps on the profile
of all its cores where the system lent them (`lend_cores`), and with
--profile-busy-peer on that profile while a peer is busy too (memory and caches are
shared: `tandem profile --beside-busy-peer`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

from bench.compare import FULL, MIX_SEED_STRIDE, QUICK
from bench.loadgen import arrivals
from bench.stats import max_rate_meeting
from bench.sweep import PROBE_SALT
from bench.workloads import Mix, WorkItem, make_items
from engine.config import ModelConfig
from engine.model_files import default_model_path
from engine.tokenizer import Tokenizer
from planner.kinds import CPU_HANDOFF_FIXED_S, model_config, sharing
from planner.profile import EngineProfile
from planner.roofline import ModelShape
from planner.search import NodeKind, attainment, colocated
from planner.simulator import ClusterSpec, WorkerSpec, simulate
from planner.slo import SLO
from planner.step_costs import StepCosts
from planner.trace import Trace

VALIDATED = ("prefill_heavy", "decode_heavy")


@dataclass(frozen=True)
class Row:
    mix: str
    system: str
    measured: float
    simulated: float
    prefill_scale: float = 1.0
    decode_offset_s: float = 0.0  # added to every decode step
    attainment: tuple[tuple[float, float, float], ...] = ()  # (rate, measured, simulated) a point

    @property
    def error(self) -> float | None:
        """|simulated - measured| / measured; 0 where both are 0 (no rate met the SLO on either
        side), None where only the measurement is 0 (no relative error is defined)."""
        if self.measured:
            return abs(self.simulated - self.measured) / self.measured
        return 0.0 if self.simulated == 0 else None


def _spec(
    system: dict[str, Any],
    profiles: dict[int, EngineProfile],
    kv_tokens: int,
    config: ModelConfig,
    busy_peer: EngineProfile | None = None,
) -> ClusterSpec:
    """`system` as the simulator's cluster, its workers on the profile of their threads. Several
    workers share one host: lent the profile of all its cores where they lent them (`lend_cores`,
    on since engine/core_ledger.py; a compare from before has no such key), contended `busy_peer`
    (their threads' profile beside a busy peer) while a peer is busy, where given."""
    profile = profiles[system["threads"]]
    lent = profiles.get(system["cores"]) if system.get("lend_cores") else None
    worker = WorkerSpec(StepCosts.fit(profile), kv_tokens)
    if system["cores"] > system["threads"] and (lent is not None or busy_peer is not None):
        worker = sharing(worker, lent, busy_peer)
    if system["colocated"]:
        return colocated(NodeKind(system["name"], worker), system["colocated"])
    gbps = profile.transfer_gbps.get("grpc", 1.0)
    kv_per_token = ModelShape.of(config, profile.dtype, profile.kv_dtype).kv_bytes_per_token
    return ClusterSpec((worker,) * system["prefill"], (worker,) * system["decode"], (),
                       CPU_HANDOFF_FIXED_S, kv_per_token / (gbps * 1e9))  # fmt: skip


def replay(
    compare: dict[str, Any],
    profiles: dict[int, EngineProfile],
    tok: Tokenizer,
    busy_peer: EngineProfile | None = None,
) -> list[Row]:
    """Simulated vs measured goodput for each validated mix and system of `compare` (see above)."""
    plan = QUICK if compare["meta"]["quick"] else FULL
    seed = compare["meta"]["seed"]
    kv_tokens = plan.num_blocks * 16
    config = model_config(str(default_model_path()))  # once: it reads the checkpoint
    rows = []
    for name in VALIDATED:
        if name not in compare:
            continue
        mix_seed = seed + MIX_SEED_STRIDE * list(FULL.mixes).index(name)
        slo = {c: SLO(s["ttft_s"], s["tpot_s"]) for c, s in compare[name]["slo"]["classes"].items()}
        for system in compare["meta"]["systems"]:
            measured = compare[name]["systems"][system["name"]]
            spec = _spec(system, profiles, kv_tokens, config, busy_peer if system["threads"] == 1 else None)
            scales = _calibration(spec, plan.mixes[name], measured["unloaded"], mix_seed, plan.probe_requests, tok)
            spec = _scaled(spec, *scales)
            points, pairs = [], []
            for j, point in enumerate(measured["points"]):
                i = point.get("index", j)  # the sweep's seed and salt offset (older runs: the position)
                items = make_items(plan.mixes[name], point["requests"], seed=mix_seed + i, salt=i)
                at = arrivals(len(items), point["rate"], "poisson", mix_seed + i)
                prompts = _prompt_tokens(tok, items)
                requests = zip(at, prompts, items, strict=True)
                trace = Trace.of([(a, p, 0, it.max_tokens, it.cls) for a, p, it in requests])
                points.append((point["rate"], attainment(trace, simulate(spec, trace), slo)))
                pairs.append((point["rate"], point["attainment"], points[-1][1]))
            goodput = max_rate_meeting(points)
            rows.append(Row(name, system["name"], measured["goodput_rps"], goodput, *scales, tuple(pairs)))
    return rows


def _prompt_tokens(tok: Tokenizer, items: list[WorkItem]) -> list[int]:
    return [len(tok.encode(tok.apply_chat_template(it.message_dicts()))) for it in items]


def _calibration(
    spec: ClusterSpec, mix: Mix, unloaded: dict[str, Any], seed: int, n: int, tok: Tokenizer
) -> tuple[float, float]:
    """(prefill scale, decode offset in seconds a step): each class's probe requests (as
    bench.sweep.probe sends them, one at a time) simulated alone; the measured median TTFT over
    the simulated one (at least 1), the measured median TPOT less the simulated one (at least 0),
    averaged over the classes by share."""
    prefill = decode = 0.0
    for share, shape in mix.classes:
        items = make_items(shape, 2 + n, seed=seed, salt=PROBE_SALT)[2:]
        alone = [(1000.0 * i, p, 0, it.max_tokens, shape.name) for i, (p, it) in
                 enumerate(zip(_prompt_tokens(tok, items), items, strict=True))]  # fmt: skip
        out = simulate(spec, Trace.of(alone))
        prefill += share * max(1.0, unloaded[shape.name]["ttft_s"] / statistics.median(out.ttft))
        decode += share * max(0.0, unloaded[shape.name]["tpot_s"] - statistics.median(out.tpot))
    return prefill, decode


def _scaled(spec: ClusterSpec, prefill: float, decode_offset_s: float) -> ClusterSpec:
    def costs(c: StepCosts) -> StepCosts:
        return replace(c.scaled(prefill, 1.0), d0=c.d0 + decode_offset_s)

    def one(w: WorkerSpec) -> WorkerSpec:
        lent, contended = (costs(c) if c is not None else None for c in (w.lent, w.contended))
        return replace(w, costs=costs(w.costs), lent=lent, contended=contended)

    return replace(spec, prefill=tuple(map(one, spec.prefill)), decode=tuple(map(one, spec.decode)),
                   colocated=tuple(map(one, spec.colocated)))  # fmt: skip

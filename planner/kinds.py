"""Node kinds for `tandem plan`: a measured profile (`tandem profile`'s JSON) or an accelerator
kept as data (planner/hardware.json), estimated by the roofline for a model's shape.

    --nodes NAME=COUNT[@PRICE]   NAME: a profile's node class, or a hardware name (H100-SXM)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from engine.config import ModelConfig
from planner.autoscale import Host
from planner.hardware import Hardware, known
from planner.measure import FULL
from planner.profile import PEER_SOURCE, DecodePoint, EngineProfile, PrefillPoint
from planner.roofline import ModelShape, estimate
from planner.search import NodeKind
from planner.simulator import WorkerSpec
from planner.step_costs import StepCosts

MODELS_FILE = Path(__file__).with_name("models.json")
CPU_KV_TOKENS = 2048 * 16  # the engine's default cache: num_blocks x block_size
GPU_KV_SHARE = 0.9  # of an accelerator's memory left after the weights, for KV
GPU_MAX_BATCH = 256
GPU_TOKEN_BUDGET = 8192
CPU_HANDOFF_FIXED_S = 0.007  # P/D's fixed cost over colocated at idle here (`tandem bench router`, README)


@dataclass(frozen=True)
class NodeCount:
    name: str
    count: int
    price: float  # an hour, one worker


def parse_nodes(text: str) -> list[NodeCount]:
    """'H100-SXM=500@12.3,H200-SXM=300@15.1' -> NodeCounts. Raises ValueError."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, rest = item.partition("=")
        count, _, price = rest.partition("@")
        try:
            n, p = int(count), float(price or 0)
        except ValueError:
            n = p = -1
        if not sep or not name or n < 1 or p < 0:
            raise ValueError(f"--nodes wants NAME=COUNT[@PRICE] (COUNT >= 1, PRICE >= 0), got {item!r}")
        out.append(NodeCount(name, n, p))
    if not out:
        raise ValueError("--nodes is empty")
    return out


def model_config(name: str) -> ModelConfig:
    """A shape from planner/models.json, or a checkpoint's (GGUF file or HF directory)."""
    shapes = json.loads(MODELS_FILE.read_text())
    if name in shapes:
        return ModelConfig(**shapes[name])
    if not Path(name).exists():
        names = sorted(k for k in shapes if not k.startswith("_"))
        raise ValueError(f"model {name!r} is neither a checkpoint nor one of {names}")
    from engine.weights import load_checkpoint

    return load_checkpoint(name)[0]


def grid_profile(model: str, dtype: str, kv_dtype: str) -> EngineProfile:
    """`tandem profile`'s full grid with no times: the points a roofline estimate fills in."""
    steps = FULL.steps
    return EngineProfile(
        "grid", "grid", model, dtype, kv_dtype,
        tuple(PrefillPoint(u, c, 0.0) for u, c in FULL.prefill),
        tuple(DecodePoint(b, b * (n + steps // 2), 0.0) for b, n in FULL.decode),
    )  # fmt: skip


def from_profile(profile: EngineProfile, price: float, available: int) -> NodeKind:
    gbps = profile.transfer_gbps.get("grpc") or max(profile.transfer_gbps.values(), default=1.0)
    worker = WorkerSpec(StepCosts.fit(profile), CPU_KV_TOKENS)
    return NodeKind(profile.node_class, worker, price, available, gbps)


def sharing(worker: WorkerSpec, lent: EngineProfile | None, contended: EngineProfile | None) -> WorkerSpec:
    """`worker` as one of several on one host (the simulator's host 0): on `lent` (all the
    host's cores) while its peers are idle, on `contended` while one is busy, where given."""
    fit = [StepCosts.fit(p) if p is not None else None for p in (lent, contended)]
    return replace(worker, host=0, lent=fit[0], contended=fit[1])


def host_kind(profiles: Sequence[EngineProfile], host: Host | None, available: int) -> NodeKind:
    """The autoscaler's node kind from its profiles (`--autoscale-profile`). On no host (each
    worker on a node of its own), the one profile. On `host`: the profile at each worker's
    threads, lent the one at all its cores (where idle workers lend theirs), contended one
    measured beside a busy peer at the worker's threads (where given), and at most `host.room`
    workers. A profile from before threads were recorded stands for any, when it is the only
    one. Raises ValueError where no profile fits."""
    if len({(p.dtype, p.kv_dtype) for p in profiles}) != 1:
        raise ValueError("the profiles must be of one engine: the same dtype and KV dtype")
    plain = [p for p in profiles if p.source != PEER_SOURCE]
    peer = [p for p in profiles if p.source == PEER_SOURCE]
    if host is None:
        if len(plain) != 1 or peer:
            raise ValueError("without one host (--join or RAY_ADDRESS), plan with one profile, not busy-peer ones")
        return from_profile(plain[0], 0.0, available)

    def at(pool: list[EngineProfile], threads: int) -> EngineProfile | None:
        return next((p for p in pool if p.threads == threads), None)

    base = at(plain, host.threads) or (plain[0] if len(plain) == 1 and not plain[0].threads else None)
    if base is None:
        have = sorted({p.threads for p in plain})
        raise ValueError(f"no profile at {host.threads} thread(s), each worker's here (profiles at: {have})")
    kind = from_profile(base, 0.0, min(available, host.room))
    lent = at(plain, host.cores) if host.lend and host.cores > host.threads else None
    contended = at(peer, host.threads)
    return kind if lent is None and contended is None else replace(kind, worker=sharing(kind.worker, lent, contended))


def from_hardware(
    hw: Hardware, config: ModelConfig, model: str, dtype: str, kv_dtype: str, price: float, available: int
) -> NodeKind:
    """kv_dtype: as resolved (planner.roofline.gpu_kv_dtype)."""
    shape = ModelShape.of(config, dtype, kv_dtype)
    profile = estimate(grid_profile(model, dtype, kv_dtype), config, hw, dtype, hw.name)
    kv_tokens = int((hw.mem_bytes * GPU_KV_SHARE - shape.weight_bytes) / shape.kv_bytes_per_token)
    if kv_tokens < 1:
        raise ValueError(f"{model} in {dtype} does not fit in {hw.name}'s {hw.mem_bytes / 1e9:.0f} GB")
    worker = WorkerSpec(
        StepCosts.fit(profile), kv_tokens, GPU_MAX_BATCH, GPU_TOKEN_BUDGET, prefill_chunk=0
    )  # as the engine on CUDA
    return NodeKind(hw.name, worker, price, available, hw.link_gbps or 10.0)


def resolve(
    nodes: list[NodeCount], profiles: list[EngineProfile], config: ModelConfig, model: str, dtype: str, kv_dtype: str
) -> list[NodeKind]:
    by_class, hardware = {p.node_class: p for p in profiles}, known()
    kinds = []
    for n in nodes:
        if n.name in by_class:
            kinds.append(from_profile(by_class[n.name], n.price, n.count))
        elif n.name in hardware:
            kinds.append(from_hardware(hardware[n.name], config, model, dtype, kv_dtype, n.price, n.count))
        else:
            raise ValueError(f"node {n.name!r}: no --profile of that node class, and not one of {sorted(hardware)}")
    return kinds

"""Accelerator facts the roofline estimator runs on: peak FLOP/s per compute dtype, memory
bandwidth and size, and a fixed cost per engine step. GPUs' come from planner/hardware.json
(datasheets); this machine's CPU is measured (`measure_cpu`)."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

FACTS_FILE = Path(__file__).with_name("hardware.json")


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]  # by compute dtype: fp32, bf16, int8
    mem_bw: float  # bytes/s
    mem_bytes: float
    step_overhead_s: float = 0.0
    link_gbps: float = 0.0  # KV transfer to another node, GB/s

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for a dtype, falling back to bf16's (a GPU runs fp16 at bf16's rate)."""
        return self.peak_flops.get(dtype) or self.peak_flops["bf16"]


def known() -> dict[str, Hardware]:
    """The accelerators kept as data."""
    raw = json.loads(FACTS_FILE.read_text())
    return {name: Hardware(name=name, **facts) for name, facts in raw.items() if not name.startswith("_")}


def measure_cpu(dtypes: tuple[str, ...], mem_bytes: float, seconds: float = 0.5) -> Hardware:
    """This CPU's facts, measured: the FLOP/s of a large matmul in each dtype (int8: the
    dynamic-quantized kernel the engine runs), and copy bandwidth (`tandem bench transfer`'s)."""
    from bench.transfer_bench import memcpy_gbps
    from engine.linear import Projection

    n = 2048
    w = torch.randn(n, n)
    peaks = {}
    for dtype in dtypes:
        x = torch.randn(n, n, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
        if dtype == "int8":
            matmul = functools.partial(Projection(w, torch.float32, int8=True), x)
        else:
            matmul = functools.partial(torch.mm, x, w.t().to(x.dtype).contiguous())
        peaks[dtype] = 2 * n**3 / _best(matmul, seconds)
    bw = 2 * memcpy_gbps() * 1e9  # a copy reads and writes each byte
    return Hardware(f"cpu-{torch.get_num_threads()}t", peaks, bw, mem_bytes)


def _best(fn: Callable[[], object], seconds: float) -> float:
    fn()
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best

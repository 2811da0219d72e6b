"""What a node can host: its GPUs (via NVML) and the Ray custom resources it advertises.

Class rule: decode is memory-bandwidth-bound and holds every running sequence's KV
cache, so a GPU is "decode" class when it has >= 100 GB of memory or >= 4000 GB/s of
memory bandwidth (H200, B200, GH200 with HBM3e); everything else is "prefill" class
(H100 SXM/PCIe/NVL, A100, L40S, L4, ...), where FLOPs matter more than bytes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pynvml

from engine.roles import ROLES

DECODE_MIN_MEMORY_GB = 100.0
DECODE_MIN_BANDWIDTH_GBPS = 4000.0
GPU_CLASSES = ("prefill", "decode")
ROLES_ENV = "TANDEM_NODE_ROLES"

# A CPU-only host (the embedded default, CI) runs one worker of each kind.
# A CPU-only host runs several small workers of each role (memory, not slots, is the limit).
DEFAULT_CPU_RESOURCES: dict[str, float] = {"prefill": 4.0, "decode": 4.0, "colocated": 4.0}

# Peak memory bandwidth (GB/s) by name, for when NVML cannot report bus width and clock.
# Checked in order, first substring match wins, so specific names come before general ones.
BANDWIDTH_TABLE_GBPS: tuple[tuple[str, float], ...] = (
    ("GB200", 8000.0),
    ("B200", 8000.0),
    ("B100", 8000.0),
    ("GH200", 4900.0),
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIE", 2000.0),
    ("H100", 3350.0),
    ("H800", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIE", 1935.0),
    ("A100", 1555.0),
    ("A800", 2039.0),
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("RTX 4090", 1008.0),
    ("RTX 6000 ADA", 960.0),
    ("T4", 320.0),
    ("V100", 900.0),
)


def classify_gpu(memory_gb: float, memory_bandwidth_gbps: float) -> str:
    """The pool a GPU suits best: "decode" if memory >= 100 GB or bandwidth >= 4000 GB/s, else "prefill"."""
    if memory_gb >= DECODE_MIN_MEMORY_GB or memory_bandwidth_gbps >= DECODE_MIN_BANDWIDTH_GBPS:
        return "decode"
    return "prefill"


def table_bandwidth_gbps(name: str) -> float:
    """Peak bandwidth from `BANDWIDTH_TABLE_GBPS` by name; 0.0 for an unknown part."""
    upper = name.upper()
    return next((bw for key, bw in BANDWIDTH_TABLE_GBPS if key.upper() in upper), 0.0)


@dataclass(frozen=True)
class GPUInfo:
    index: int
    name: str
    memory_gb: float
    memory_bandwidth_gbps: float
    sm_count: int
    gpu_class: str

    def __post_init__(self) -> None:
        if self.gpu_class not in GPU_CLASSES:
            raise ValueError(f"gpu_class must be one of {GPU_CLASSES}, got {self.gpu_class!r}")
        if self.memory_gb < 0 or self.memory_bandwidth_gbps < 0 or self.sm_count < 0:
            raise ValueError(f"negative GPU figures: {self}")

    @classmethod
    def of(cls, index: int, name: str, memory_gb: float, memory_bandwidth_gbps: float, sm_count: int = 0) -> GPUInfo:
        """A GPUInfo whose class follows `classify_gpu`."""
        gpu_class = classify_gpu(memory_gb, memory_bandwidth_gbps)
        return cls(index, name, memory_gb, memory_bandwidth_gbps, sm_count, gpu_class)


def _nvml_or(default: Any, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except (pynvml.NVMLError, AttributeError):
        return default


def _device_info(index: int) -> GPUInfo:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    name = pynvml.nvmlDeviceGetName(handle)
    name = name.decode() if isinstance(name, bytes) else str(name)
    memory_gb = pynvml.nvmlDeviceGetMemoryInfo(handle).total / 1e9
    attributes = _nvml_or(None, pynvml.nvmlDeviceGetAttributes, handle)
    sm_count = int(getattr(attributes, "multiprocessorCount", 0) or 0)
    bus_bits = int(_nvml_or(0, pynvml.nvmlDeviceGetMemoryBusWidth, handle) or 0)
    mem_clock_mhz = int(_nvml_or(0, pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_MEM) or 0)
    # Double data rate: two transfers per memory clock, `bus_bits / 8` bytes each.
    bandwidth = bus_bits * mem_clock_mhz * 2 / 8 / 1000
    if bandwidth <= 0:
        bandwidth = table_bandwidth_gbps(name)
    return GPUInfo.of(index, name, round(memory_gb, 1), round(bandwidth, 1), sm_count)


def gpu_inventory() -> list[GPUInfo]:
    """The node's NVIDIA GPUs, by NVML index. [] when there is no driver, no GPU, or NVML fails; never raises."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        return [_device_info(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError:
        return []
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def parse_roles(spec: str) -> dict[str, float]:
    """Parse "prefill=1,decode=2" into {"prefill": 1.0, "decode": 2.0}; zero counts are dropped.

    Raises ValueError for an unknown role, a repeated role, a malformed item or a negative count.
    """
    resources: dict[str, float] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        role, sep, count = (s.strip() for s in item.partition("="))
        if not sep or role not in ROLES:
            raise ValueError(f"bad role {item!r} in {spec!r}: expected role=count with role in {ROLES}")
        if role in resources:
            raise ValueError(f"role {role!r} given twice in {spec!r}")
        try:
            value = float(count)
        except ValueError:
            raise ValueError(f"bad count {count!r} for {role!r} in {spec!r}") from None
        if not value >= 0:
            raise ValueError(f"count for {role!r} must be >= 0, got {count!r}")
        resources[role] = value
    return {role: value for role, value in resources.items() if value > 0}


def node_resources(role_config: str | None = None, gpus: Sequence[GPUInfo] | None = None) -> dict[str, float]:
    """The Ray custom resources this node advertises: worker slots per role.

    First match wins:
    1. `role_config`, else the `TANDEM_NODE_ROLES` env var (e.g. "prefill=1,decode=1"): an operator
       override, on GPU hosts too (say, to run decode on H100s);
    2. the GPUs (`gpus`, else `gpu_inventory()`): one slot per GPU of each class,
       {"prefill": n, "decode": m}, a class with no GPU left out;
    3. a CPU-only host: `DEFAULT_CPU_RESOURCES`, four slots each of prefill, decode and colocated.

    Raises ValueError for a malformed config (see `parse_roles`).
    """
    spec = role_config if role_config is not None else os.environ.get(ROLES_ENV, "")
    if spec.strip():
        return parse_roles(spec)
    found = gpu_inventory() if gpus is None else list(gpus)
    if not found:
        return dict(DEFAULT_CPU_RESOURCES)
    resources: dict[str, float] = {}
    for gpu in found:
        resources[gpu.gpu_class] = resources.get(gpu.gpu_class, 0.0) + 1.0
    return resources

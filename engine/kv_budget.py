"""How many KV blocks an engine gets when its config names none (`num_blocks=None`, `tandem serve
--num-blocks auto`, the default there).

A fixed count fits no host: 512 blocks of SmolLM2 in bf16 are 189 MB, one 8K context, so a
decode worker ran ~10 streams that each reserved 256 + 512 tokens while gigabytes sat free
(C = 32 of them waited 11 s on average for room). The count comes from the memory instead:

    budget = min(KV_CAP_BYTES, KV_SHARE x available x this worker's threads / the host's cores)
    blocks = max(budget // bytes of a block, the blocks of one full context)

Workers of one host split its memory as they split its cores (a worker that takes every core
takes the whole share). `available` is MemAvailable, or the cgroup's limit less its usage where
that is lower (a container). On a GPU, which a worker has to itself: GPU_SHARE of the device's
free memory once the weights are on it, no cap. `auto_blocks` is the rule, pure; `cache_blocks`
puts an engine's facts to it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.paged_cache import block_bytes

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.kv_codec import KVCodec
    from engine.model import LlamaModel

log = logging.getLogger(__name__)

KV_SHARE = 0.25  # of the host's available memory, over all its workers
KV_CAP_BYTES = 2 << 30  # a worker's at most, on a CPU
GPU_SHARE = 0.8  # of a GPU's free memory after the weights


@dataclass(frozen=True)
class KVBudget:
    """An engine's KV cache, sized: `num_blocks`, and the numbers that chose it (for its log line)."""

    num_blocks: int
    budget_bytes: int
    available_bytes: int
    share: float  # of the host's memory this worker may take (its cores' share of KV_SHARE)
    cap: int | None

    def describe(self, block_bytes: int, block_size: int) -> str:
        mb = self.num_blocks * block_bytes >> 20
        capped = f", at most {self.cap >> 20:,} MB" if self.cap is not None else ""
        return (f"{self.num_blocks} blocks ({self.num_blocks * block_size:,} tokens, {mb:,} MB): "
                f"{self.share:.3g} of {self.available_bytes >> 20:,} MB available{capped}")  # fmt: skip


def cache_blocks(model: LlamaModel, codec: KVCodec, config: EngineConfig, max_model_len: int) -> int:
    """num_blocks for an engine on the model's device: the config's, checked against the memory
    there, or where it names none, sized from it (logged). Raises ValueError for a count that
    cannot fit: it used to be taken as asked, and 10^8 blocks' bookkeeping alone ate the host
    until the kernel killed a process of its choosing (the pool manager, once)."""
    block_size = config.block_size
    size = block_bytes(model.config, block_size, codec)
    if model.device.type == "cuda":
        room, _ = torch.cuda.mem_get_info(model.device)
        host, cap = 1.0, None
    else:
        room, host, cap = available_bytes(), host_share(config.num_threads, os.cpu_count()), KV_CAP_BYTES
    if config.num_blocks is not None:
        check_fits(config.num_blocks, size, room, host)
        return config.num_blocks
    share = GPU_SHARE if model.device.type == "cuda" else cpu_share(config.num_threads, os.cpu_count())
    sized = auto_blocks(size, block_size, max_model_len, room, share, cap)
    log.info("KV cache auto -> %s", sized.describe(size, block_size))
    return sized.num_blocks


def check_fits(num_blocks: int, block_bytes: int, room: int, share: float) -> None:
    """ValueError where `num_blocks` blocks of `block_bytes` need more than `share` of `room`
    bytes (the worker's part of what its host or device has free; 0: unknown, not checked). A
    cache on the CPU takes its pages as requests fill it, so one that does not fit would start
    and then fail under load."""
    need, limit = num_blocks * block_bytes, int(room * min(max(share, 0.0), 1.0))
    if room and need > limit:
        gib = 1 << 30
        raise ValueError(f"num_blocks {num_blocks:,}: a KV cache of {need / gib:,.1f} GiB does not fit the "
                         f"{limit / gib:,.1f} GiB this worker may take ({share:.2g} of the {room / gib:,.1f} GiB "
                         "free here); name fewer blocks, or none to size the cache from the memory")  # fmt: skip


def auto_blocks(
    block_bytes: int, block_size: int, max_model_len: int, available: int, share: float, cap: int | None
) -> KVBudget:
    """The blocks a budget of `share` x `available` bytes (at most `cap`) holds, at least one
    full context's."""
    if block_bytes < 1 or block_size < 1 or max_model_len < 1:
        raise ValueError(f"block_bytes, block_size and max_model_len must be >= 1, got "
                         f"{block_bytes}, {block_size}, {max_model_len}")  # fmt: skip
    budget = int(max(available, 0) * min(max(share, 0.0), 1.0))
    if cap is not None:
        budget = min(budget, cap)
    one_context = -(-max_model_len // block_size)
    return KVBudget(max(budget // block_bytes, one_context), budget, available, share, cap)


def host_share(num_threads: int | None, cores: int | None) -> float:
    """The part of its host a worker takes: its threads over the host's cores (all of them:
    None); `tandem serve` splits os.cpu_count() (router/server.py)."""
    if not num_threads or not cores:
        return 1.0
    return min(num_threads / cores, 1.0)


def cpu_share(num_threads: int | None, cores: int | None) -> float:
    """KV_SHARE, in proportion to the host's cores this worker was given (host_share)."""
    return KV_SHARE * host_share(num_threads, cores)


def available_bytes(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Memory this process's host (or container) can still give, in bytes; 0 if unknown."""
    host = 0
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                host = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    room = _cgroup_room(cgroup)
    if room is None:
        return host
    return min(host, room) if host else room


def _cgroup_room(root: Path) -> int | None:
    """The cgroup's limit less its usage (v2, then v1), or None where it sets no limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):  # fmt: skip
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1 says "no limit" with a huge number
            return None
        return max(int(limit) - usage, 0)
    return None

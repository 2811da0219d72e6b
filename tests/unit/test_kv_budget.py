"""The KV cache sized from memory (engine/kv_budget.py): the rule, and where the memory figure comes from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kv_budget import KV_SHARE, auto_blocks, available_bytes, check_fits, cpu_share, host_share
from engine.model import LlamaModel
from router import serve_args
from tests.unit.tiny import make_engine


def test_blocks_are_the_share_of_memory_a_block_size_each() -> None:
    sized = auto_blocks(block_bytes=1000, block_size=16, max_model_len=160, available=1_000_000, share=0.25, cap=None)
    assert (sized.num_blocks, sized.budget_bytes, sized.available_bytes) == (250, 250_000, 1_000_000)
    assert sized.describe(1000, 16) == "250 blocks (4,000 tokens, 0 MB): 0.25 of 0 MB available"
    big = auto_blocks(1 << 20, 16, 160, 64 << 30, 0.125, cap=2 << 30)
    assert (
        big.describe(1 << 20, 16)
        == "2048 blocks (32,768 tokens, 2,048 MB): 0.125 of 65,536 MB available, at most 2,048 MB"
    )


def test_the_cap_bounds_the_budget_and_one_context_is_the_floor() -> None:
    assert auto_blocks(1000, 16, 160, 1_000_000, 0.25, cap=100_000).num_blocks == 100
    assert auto_blocks(1000, 16, 160, 1_000, 0.25, cap=100_000).num_blocks == 10  # 160 tokens: 10 blocks
    assert auto_blocks(1000, 16, 161, 0, 0.25, cap=None).num_blocks == 11  # unknown memory: one context
    assert auto_blocks(1000, 16, 160, 1_000_000, 3.0, cap=None).num_blocks == 1000  # a share is at most all


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="block_bytes"):
        auto_blocks(0, 16, 160, 1_000_000, 0.25, None)


def test_a_count_named_must_fit_the_workers_part_of_the_memory(tiny_model: LlamaModel) -> None:
    """(An engine it builds sets the process's torch threads from its config: naming num_threads here
    left every later test of the session on one thread, CI-102 and CI-103 2-4 minutes slower.)"""
    mib, room = 1 << 20, 8 << 30
    check_fits(4096, mib, room, 0.5)  # 4 GiB of 4 GiB: fits
    check_fits(10**12, mib, 0, 0.5)  # the memory unknown: not checked
    with pytest.raises(ValueError) as e:
        check_fits(5000, mib, room, 0.5)
    assert str(e.value) == (
        "num_blocks 5,000: a KV cache of 4.9 GiB does not fit the 4.0 GiB this worker may take "
        "(0.5 of the 8.0 GiB free here); name fewer blocks, or none to size the cache from the memory"
    )
    with pytest.raises(ValueError, match=r"^num_blocks 1,000,000,000,000: a KV cache of 1,907,348\.6 GiB does not fit"):
        make_engine(tiny_model, num_blocks=10**12)  # refused before anything is allocated
    assert make_engine(tiny_model, num_blocks=64).kv.num_blocks == 64


def test_a_refused_engine_leaves_the_process_torch_threads_as_they_were(tiny_model: LlamaModel) -> None:
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match="does not fit"):
        make_engine(tiny_model, num_blocks=10**12, num_threads=before + 1)
    assert torch.get_num_threads() == before


def test_workers_of_a_host_split_its_memory_as_its_cores() -> None:
    assert (host_share(1, 2), host_share(None, 2), host_share(4, 2), host_share(1, None)) == (0.5, 1.0, 1.0, 1.0)
    assert cpu_share(1, 2) == KV_SHARE / 2
    assert cpu_share(None, 2) == KV_SHARE  # all the cores
    assert cpu_share(4, 2) == KV_SHARE  # never more than all
    assert cpu_share(1, None) == KV_SHARE


def _files(tmp: Path, meminfo: str | None, cgroup: dict[str, int | str] | None = None) -> tuple[Path, Path]:
    """A /proc/meminfo and a cgroup root holding `cgroup` ({path under the root: content})."""
    (tmp / "cg" / "memory").mkdir(parents=True)
    if meminfo is not None:
        (tmp / "meminfo").write_text(meminfo)
    for name, value in (cgroup or {}).items():
        (tmp / "cg" / name).write_text(str(value))
    return tmp / "meminfo", tmp / "cg"


MEMINFO = "MemTotal:       24000000 kB\nMemFree:        10000000 kB\nMemAvailable:   20000000 kB\n"


def test_available_memory_is_the_hosts_or_the_containers_if_lower(tmp_path: Path) -> None:
    host = 20_000_000 * 1024
    assert available_bytes(*_files(tmp_path / "a", MEMINFO)) == host
    v2 = {"memory.max": 8 << 30, "memory.current": 3 << 30}
    assert available_bytes(*_files(tmp_path / "b", MEMINFO, v2)) == 5 << 30
    unlimited = {"memory.max": "max", "memory.current": 3 << 30}
    assert available_bytes(*_files(tmp_path / "c", MEMINFO, unlimited)) == host
    v1 = {"memory/memory.limit_in_bytes": 2 << 30, "memory/memory.usage_in_bytes": 1 << 30}
    assert available_bytes(*_files(tmp_path / "d", MEMINFO, v1)) == 1 << 30
    v1_unlimited = {"memory/memory.limit_in_bytes": 2**63 - 4096, "memory/memory.usage_in_bytes": 1 << 30}
    assert available_bytes(*_files(tmp_path / "e", MEMINFO, v1_unlimited)) == host
    over = {"memory.max": 1 << 30, "memory.current": 2 << 30}
    assert available_bytes(*_files(tmp_path / "f", MEMINFO, over)) == 0
    assert available_bytes(*_files(tmp_path / "g", None)) == 0  # nothing to read: unknown
    container_only = {"memory.max": 4 << 30, "memory.current": 0}
    assert available_bytes(*_files(tmp_path / "h", None, container_only)) == 4 << 30


def test_serve_sizes_kv_from_memory_unless_told() -> None:
    assert serve_args.parse([]).num_blocks is None
    assert serve_args.parse(["--num-blocks", "auto"]).num_blocks is None
    assert serve_args.parse(["--num-blocks", "96"]).num_blocks == 96
    # a bad count is a usage error: tests/unit/test_serve_port.py

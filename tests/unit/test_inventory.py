from __future__ import annotations

from pathlib import Path

import pytest

from cluster.inventory import (
    DEFAULT_CPU_RESOURCES,
    ROLES_ENV,
    GPUInfo,
    classify_gpu,
    gpu_inventory,
    node_resources,
    parse_roles,
    table_bandwidth_gbps,
)

H200 = GPUInfo.of(0, "NVIDIA H200", 150.1, 4800.0, 132)
H100 = GPUInfo.of(1, "NVIDIA H100 80GB HBM3", 85.1, 3352.3, 132)
L40S = GPUInfo.of(2, "NVIDIA L40S", 48.3, 864.0, 142)


def test_gpu_inventory_without_driver_is_empty_or_well_formed() -> None:
    gpus = gpu_inventory()
    if not Path("/dev/nvidiactl").exists():
        assert gpus == []
    for i, gpu in enumerate(gpus):
        assert gpu.index == i and gpu.memory_gb > 0 and gpu.gpu_class in ("prefill", "decode")


@pytest.mark.parametrize(
    ("memory_gb", "bandwidth", "expected"),
    [
        (141.0, 4800.0, "decode"),  # H200
        (192.0, 8000.0, "decode"),  # B200
        (100.0, 0.0, "decode"),  # memory alone is enough
        (96.0, 4000.0, "decode"),  # bandwidth alone is enough
        (94.0, 3900.0, "prefill"),  # H100 NVL
        (80.0, 3350.0, "prefill"),  # H100 SXM
        (80.0, 2039.0, "prefill"),  # A100 80GB
        (48.0, 864.0, "prefill"),  # L40S
        (0.0, 0.0, "prefill"),
    ],
)
def test_class_rule(memory_gb: float, bandwidth: float, expected: str) -> None:
    assert classify_gpu(memory_gb, bandwidth) == expected
    assert GPUInfo.of(0, "x", memory_gb, bandwidth).gpu_class == expected


def test_gpuinfo_validates() -> None:
    with pytest.raises(ValueError, match="gpu_class"):
        GPUInfo(0, "x", 80.0, 3350.0, 132, "colocated")
    with pytest.raises(ValueError, match="negative"):
        GPUInfo(0, "x", -1.0, 3350.0, 132, "prefill")
    assert (H200.gpu_class, H100.gpu_class, L40S.gpu_class) == ("decode", "prefill", "prefill")


def test_bandwidth_table_prefers_specific_names() -> None:
    assert table_bandwidth_gbps("NVIDIA H200") == 4800.0
    assert table_bandwidth_gbps("NVIDIA GH200 480GB") == 4900.0
    assert table_bandwidth_gbps("NVIDIA H100 NVL") == 3900.0
    assert table_bandwidth_gbps("NVIDIA H100 PCIe") == 2000.0
    assert table_bandwidth_gbps("NVIDIA H100 80GB HBM3") == 3350.0
    assert table_bandwidth_gbps("NVIDIA A100-SXM4-80GB") == 2039.0
    assert table_bandwidth_gbps("NVIDIA A100-SXM4-40GB") == 1555.0
    assert table_bandwidth_gbps("NVIDIA L40S") == 864.0
    assert table_bandwidth_gbps("NVIDIA L4") == 300.0
    assert table_bandwidth_gbps("Mystery Accelerator") == 0.0


def test_node_resources_from_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ROLES_ENV, raising=False)
    assert node_resources(gpus=[H200, H100, L40S]) == {"decode": 1.0, "prefill": 2.0}
    assert node_resources(gpus=[H200, H200]) == {"decode": 2.0}


def test_node_resources_cpu_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ROLES_ENV, raising=False)
    assert node_resources(gpus=[]) == DEFAULT_CPU_RESOURCES == {"prefill": 4.0, "decode": 4.0, "colocated": 4.0}
    monkeypatch.setenv(ROLES_ENV, "  ")
    assert node_resources(gpus=[]) == DEFAULT_CPU_RESOURCES


def test_node_resources_config_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ROLES_ENV, "prefill=2, decode=1")
    assert node_resources(gpus=[]) == {"prefill": 2.0, "decode": 1.0}
    assert node_resources(gpus=[H100]) == {"prefill": 2.0, "decode": 1.0}
    assert node_resources("decode=4,colocated=0", gpus=[H100]) == {"decode": 4.0}


@pytest.mark.parametrize("spec", ["gpu=1", "prefill", "prefill=x", "prefill=-1", "prefill=1,prefill=2", "decode=nan"])
def test_parse_roles_rejects(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_roles(spec)


def test_parse_roles_accepts() -> None:
    assert parse_roles("prefill=1,decode=0.5,") == {"prefill": 1.0, "decode": 0.5}
    assert parse_roles("") == {}

"""Every YAML under deploy/ passes Ray's own cluster-config validation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("*.yaml")), ids=lambda p: p.name)
def test_ray_accepts_the_cluster_config(path: Path) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(yaml.safe_load(path.read_text()))  # fills Ray's defaults, as `ray up` does
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_roles_are_advertised() -> None:
    aws = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    types = aws["available_node_types"]
    assert types["prefill_h100"]["resources"] == {"prefill": 8, "GPU": 8}
    assert types["decode_h200"]["resources"] == {"decode": 8, "GPU": 8}
    assert "tandem serve" in " ".join(aws["head_start_ray_commands"])
    assert "TANDEM_DEVICE=cuda" in " ".join(aws["head_start_ray_commands"])  # a worker a GPU
    assert "whl/cu" in " ".join(aws["worker_setup_commands"])  # the CUDA wheel on GPU nodes


def test_the_autoscaler_section_is_opt_in() -> None:
    head = " ".join(yaml.safe_load((DEPLOY / "cluster.yaml").read_text())["head_start_ray_commands"])
    assert 'TANDEM_AUTOSCALE=""' in head and "TANDEM_SLO=" in head  # off until an operator sets bounds


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("*.yaml")), ids=lambda p: p.name)
def test_every_ray_start_runs_its_workers_at_nice_0(path: Path) -> None:
    """Ray starts its workers at nice 15 unless told (cluster.config.ray_env, for a Ray that
    `tandem serve` starts itself): the engines would get nothing of a core a nice-0 process wants."""
    config = yaml.safe_load(path.read_text())
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config.get(key, []) if "ray start" in c]
        assert all("RAY_worker_niceness=0" in c for c in starts), (key, starts)


def test_a_ray_started_by_tandem_runs_its_workers_at_nice_0(monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.config import WORKER_NICENESS, ray_env

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != WORKER_NICENESS})
    ray_env()
    assert os.environ[WORKER_NICENESS] == "0"
    os.environ[WORKER_NICENESS] = "5"  # an operator's own choice stands
    ray_env()
    assert os.environ[WORKER_NICENESS] == "5"

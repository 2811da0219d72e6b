"""`tandem bench serve` against the real router over a real 1P+1D cluster: a short smoke run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.harness import running_cluster, serving
from bench.serve_bench import main
from cluster.cluster import ClusterConfig
from engine.config import EngineConfig

PROMPTS = [
    {"messages": [{"role": "user", "content": "Name a river."}], "max_tokens": 6},
    {"prompt": "The capital of France is", "max_tokens": 4},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}], "max_tokens": 5},
]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    config = ClusterConfig(namespace="bench-itest", engine=EngineConfig(dtype="fp32", num_blocks=256, num_threads=1))
    with running_cluster(config, timeout_s=240) as cluster, serving(cluster) as base:
        yield base


def test_bench_serve_smoke(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS))
    out = tmp_path / "out"
    argv = ["--url", url + "/v1", "--prompts", str(prompts), "--rate", "2,4", "--num-requests", "4",
            "--slo-ttft", "30", "--slo-tpot", "2", "--json", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["rate"] for r in res["runs"]] == [2.0, 4.0]
    for run in res["runs"]:
        assert run["requests"] == run["completed"] == 4 and run["failed"] == 0
        assert 0 < run["ttft_s"]["p50"] <= run["e2e_s"]["p50"] and run["tpot_s"]["p50"] > 0
        assert run["slo_attainment"] == 1.0 and run["goodput_rps"] > 0 and run["output_tok_s"] > 0
        assert set(run["breakdown"]) == {"queue_s", "route_s", "prefill_s", "transfer_s", "first_decode_s", "decode_s"}
        assert run["breakdown"]["prefill_s"]["mean"] > 0 and run["prefix_hit_rate"] is not None
    lines = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == 8 and all(r["ok"] for r in lines)
    assert sorted({r["output_tokens"] for r in lines}) == [4, 5, 6]  # ignore_eos: every answer runs to max_tokens
    assert all(r["timing"]["prefill_worker"] and r["timing"]["transfer_bytes"] > 0 for r in lines)
    assert json.loads((out / "results.json").read_text())["runs"] == res["runs"]
    for png in ("latency_cdf.png", "slo_attainment.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(res["files"]) == {str(out / f) for f in ("requests.jsonl", "latency_cdf.png", "slo_attainment.png",
                                                        "results.json")}  # fmt: skip


def test_bench_serve_text_report_closed_loop(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS))
    argv = ["--url", url, "--prompts", str(prompts), "--concurrency", "2", "--num-requests", "3",
            "--out", "", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "concurrency 2" in text and "TTFT p50/p90/p99" in text and "server breakdown" in text
    assert "3/3" in text.replace(" ", "") and "wrote" not in text

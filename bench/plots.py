"""PNG plots (matplotlib, Agg backend): latency CDFs and SLO attainment against request rate."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display: the benchmarks run on headless machines

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from bench.stats import SLO, RequestResult


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def latency_cdfs(series: Mapping[str, Sequence[RequestResult]], path: str | Path, slo: SLO, title: str = "") -> Path:
    """TTFT, TPOT and E2E CDFs side by side, one line per series (successful requests only);
    the SLOs as dashed lines."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    metrics = (("TTFT (s)", "ttft", slo.ttft_s), ("TPOT (s)", "tpot", slo.tpot_s), ("E2E (s)", "e2e", None))
    for ax, (label, attr, bound) in zip(axes, metrics, strict=True):
        for name, results in series.items():
            vals = [float(v) for r in results if r.ok and (v := getattr(r, attr)) is not None]
            if vals:
                xs, ys = _cdf(vals)
                ax.step(xs, ys, where="post", label=name)
        if bound is not None:
            ax.axvline(bound, color="grey", linestyle="--", label="SLO")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def attainment_vs_rate(
    panels: Mapping[str, Mapping[str, Sequence[tuple[float, float]]]],
    path: str | Path,
    target: float = 0.9,
    title: str = "",
) -> Path:
    """One panel per workload, side by side; in each, one attainment-vs-rate curve per system
    and the target as a dashed line."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, (panel, curves) in zip(axes[0], panels.items(), strict=True):
        for name, points in curves.items():
            pts = sorted(points)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.axhline(target, color="grey", linestyle="--", label=f"{target:.0%} target")
        ax.set_title(panel)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def attainment_timeline(
    runs: Mapping[str, Sequence[tuple[float, float | None]]], step_s: float, path: str | Path, target: float = 0.9
) -> Path:
    """One attainment-over-time line per run (window start, attainment), the step as a vertical line."""
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for name, line in runs.items():
        pts = [(t, a) for t, a in line if a is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.axhline(target, color="grey", linestyle="--", label=f"{target:.0%} target")
    ax.axvline(step_s, color="black", linestyle=":", label="load step")
    ax.set_xlabel("request sent at (s)")
    ax.set_ylabel("SLO attainment of the window")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig: Figure, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=100)
    plt.close(fig)
    return p

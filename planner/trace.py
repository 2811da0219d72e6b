"""A request trace for the simulator: arrival time, prompt, cached and output tokens, class.

JSONL, one request a line, in arrival order:

    {"arrival": 0.125, "prompt": 512, "cached": 0, "output": 64, "class": "chat"}

`cached` (tokens of the prompt already in some worker's prefix cache) and `class` may be left
out. `synthetic` draws one from a workload mix (bench.workloads) with Poisson arrivals, at a
steady rate or along a day's curve.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from bench.workloads import Mix


@dataclass(frozen=True)
class Trace:
    """Columns, one entry a request, sorted by arrival (seconds from the trace's start)."""

    arrival: tuple[float, ...]
    prompt: tuple[int, ...]
    cached: tuple[int, ...]
    output: tuple[int, ...]
    cls: tuple[str, ...]

    def __post_init__(self) -> None:
        n = len(self.arrival)
        if not all(len(c) == n for c in (self.prompt, self.cached, self.output, self.cls)):
            raise ValueError("trace columns differ in length")
        if any(b < a for a, b in zip(self.arrival, self.arrival[1:], strict=False)):
            raise ValueError("trace arrivals must be in order")
        for p, c, o in zip(self.prompt, self.cached, self.output, strict=True):
            if p < 1 or o < 1 or not 0 <= c < p:
                raise ValueError(f"need prompt >= 1, output >= 1, 0 <= cached < prompt: got {p}, {o}, {c}")

    def __len__(self) -> int:
        return len(self.arrival)

    @property
    def duration_s(self) -> float:
        return self.arrival[-1] - self.arrival[0] if self.arrival else 0.0

    @property
    def rate(self) -> float:
        """Mean arrivals a second."""
        return (len(self) - 1) / self.duration_s if self.duration_s > 0 else 0.0

    def at_rate(self, factor: float) -> Trace:
        """The same requests with arrivals `factor` times as frequent."""
        t0 = self.arrival[0] if self.arrival else 0.0
        return Trace(tuple((a - t0) / factor for a in self.arrival), self.prompt, self.cached, self.output, self.cls)

    def save(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for a, p, c, o, k in zip(self.arrival, self.prompt, self.cached, self.output, self.cls, strict=True):
                f.write(json.dumps({"arrival": a, "prompt": p, "cached": c, "output": o, "class": k}) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        rows = []
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                rows.append((float(d["arrival"]), int(d["prompt"]), int(d.get("cached", 0)), int(d["output"]),
                             str(d.get("class", ""))))  # fmt: skip
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a trace request ({e!r}): {line[:120]}") from None
        return cls.of(rows)

    @classmethod
    def of(cls, rows: list[tuple[float, int, int, int, str]]) -> Trace:
        if not rows:
            raise ValueError("a trace needs at least one request")
        a, p, c, o, k = zip(*rows, strict=True)
        return cls(a, p, c, o, k)


def synthetic(mix: Mix, rate: float, n: int, seed: int = 0, curve: tuple[float, ...] = ()) -> Trace:
    """n requests of `mix`'s classes (by their shares), Poisson arrivals at `rate` a second; with
    `curve`, the rate follows it: rate x curve[i] over the i-th of len(curve) equal spans of the
    expected duration (a day's hours, say), wrapping around."""
    rng = random.Random(seed)
    classes = mix.classes
    weights = [s for s, _ in classes]
    span = n / rate / len(curve) if curve else 0.0
    t, rows = 0.0, []
    for _ in range(n):
        r = rate * curve[int(t / span) % len(curve)] if curve else rate
        t += rng.expovariate(r)
        shape = rng.choices(classes, weights)[0][1]
        rows.append((t, shape.input.sample(rng) + shape.system, 0, shape.output.sample(rng), shape.name))
    return Trace.of(rows)


def day_curve(hours: int = 24, off_peak: float = 0.25) -> tuple[float, ...]:
    """Relative arrival rate by hour: 1.0 at the peak (15:00), `off_peak` at the trough (03:00)."""
    mid, amp = (1 + off_peak) / 2, (1 - off_peak) / 2
    return tuple(mid + amp * math.cos(2 * math.pi * (h - 15) / hours) for h in range(hours))

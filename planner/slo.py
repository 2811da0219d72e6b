"""SLO: the latency a request must meet (TTFT and TPOT), and its command-line form."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float


def parse_slo(text: str) -> SLO:
    """'ttft=2,tpot=50ms' -> SLO(2.0, 0.05): seconds, or with an 'ms' or 's' suffix. Raises ValueError."""
    got: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        scale = 1e-3 if value.endswith("ms") else 1.0
        try:
            got[key.strip()] = float(value.removesuffix("ms").removesuffix("s")) * scale
        except ValueError:
            raise ValueError(f"SLO: {item!r} is not KEY=SECONDS") from None
    if set(got) != {"ttft", "tpot"} or min(got.values()) <= 0:
        raise ValueError(f"an SLO wants ttft=...,tpot=... (both > 0), got {text!r}")
    return SLO(got["ttft"], got["tpot"])

"""StepCosts: the time of one engine step, fitted to a profile's points, as the simulator asks it.

    prefill chunk of n tokens after c in context:  p0 + p1*n + p2*(n*c + n*n/2)
    decode step of B requests over C context:      d0 + d1*B + d2*C
    a mixed step (colocated: decodes and chunks):  both, with one fixed cost (the larger)

The forms are the roofline's (planner.roofline): a fixed cost a step, the projections linear in
tokens, attention linear in the context it reads. The coefficients are least squares over the
profile's points, kept >= 0; a profile with too few points of one kind gets that kind's terms
from fewer coefficients (a fixed cost and a per-token cost, or a per-token cost alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.profile import EngineProfile


@dataclass(frozen=True)
class StepCosts:
    p0: float
    p1: float
    p2: float
    d0: float
    d1: float
    d2: float

    def prefill(self, tokens: int, attention: float) -> float:
        """A step of prefill chunks only: `tokens` in all, `attention` = the sum over its chunks
        of n*c + n*n/2 (see `attention_work`)."""
        return self.p0 + self.p1 * tokens + self.p2 * attention

    def decode(self, batch: int, context: int) -> float:
        return self.d0 + self.d1 * batch + self.d2 * context

    def mixed(self, batch: int, context: int, tokens: int, attention: float) -> float:
        """A step with `batch` decodes and prefill chunks of `tokens` in all; either may be empty."""
        if not tokens:
            return self.decode(batch, context)
        if not batch:
            return self.prefill(tokens, attention)
        return max(self.p0, self.d0) + self.d1 * batch + self.d2 * context + self.p1 * tokens + self.p2 * attention

    def scaled(self, prefill: float, decode: float) -> StepCosts:
        """Every prefill term times `prefill`, every decode term times `decode`."""
        p, d = prefill, decode
        return StepCosts(self.p0 * p, self.p1 * p, self.p2 * p, self.d0 * d, self.d1 * d, self.d2 * d)

    @classmethod
    def fit(cls, profile: EngineProfile) -> StepCosts:
        pre = [(1.0, p.uncached, attention_work(p.uncached, p.cached), p.seconds) for p in profile.prefill]
        dec = [(1.0, p.batch, p.context, p.seconds) for p in profile.decode]
        if not pre or not dec:
            raise ValueError(f"profile {profile.node_class} needs prefill and decode points")
        p0, p1, p2 = _nonneg_lstsq(pre)
        d0, d1, d2 = _nonneg_lstsq(dec)
        return cls(p0, p1, p2, d0, d1, d2)


def attention_work(n: int, context: int) -> float:
    """A chunk of n new tokens after `context` ones: query-key pairs it attends, causally."""
    return n * context + n * n / 2


def _nonneg_lstsq(rows: Sequence[tuple[float, float, float, float]]) -> tuple[float, float, float]:
    """Least squares of y = a*x0 + b*x1 + c*x2 with a, b, c >= 0 (active set: drop the
    most negative coefficient and refit). Rows are weighted by 1/y: relative error counts."""
    x = np.array([r[:3] for r in rows], dtype=np.float64)
    y = np.array([r[3] for r in rows], dtype=np.float64)
    w = 1.0 / np.maximum(y, 1e-12)
    active = [0, 1, 2]
    while active:
        cols = x[:, active] * w[:, None]
        coef, *_ = np.linalg.lstsq(cols, y * w, rcond=None)
        if (coef >= 0).all():
            out = [0.0, 0.0, 0.0]
            for i, c in zip(active, coef, strict=True):
                out[i] = float(c)
            return out[0], out[1], out[2]
        active.pop(int(np.argmin(coef)))
    return 0.0, 0.0, 0.0

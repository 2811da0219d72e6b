"""Which route a request takes after attempts that failed before its first token.

Exclusions go strictest first (every worker of the failed routes, then their prefill workers,
then their decode workers: a failure does not always say which side of a pair broke), and of
the untried routes they give, the best is taken: one with no worker a failure named
(`suspects`, when the cluster saw which one died) and a P/D pair, before the whole request on
the one pool left (Route.fallback), before a route through a suspect.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cluster.cluster import NoWorkerError
from cluster.routing import Route


def retry_route(route: Callable[[frozenset[str]], Route], failed: Sequence[Route], suspects: frozenset[str]) -> Route:
    """The best untried route `route(exclude)` gives over the exclusions of `failed` (see above).
    Raises NoWorkerError."""
    tried = {r.workers for r in failed}
    best: tuple[tuple[bool, bool], Route] | None = None
    for exclude in retry_exclusions(failed):
        try:
            candidate = route(exclude)
        except NoWorkerError:
            continue
        if candidate.workers in tried:
            continue
        rank = (bool(candidate.workers & suspects), candidate.fallback)
        if rank == (False, False):
            return candidate
        if best is None or rank < best[0]:
            best = (rank, candidate)
    if best is not None:
        return best[1]
    raise NoWorkerError(f"no other worker pair to retry on after {len(failed)} failure(s)")


def retry_exclusions(failed: Sequence[Route]) -> list[frozenset[str]]:
    """Workers to avoid when retrying after `failed` routes broke before their first token,
    strictest first: every worker of a failed route; then only their prefill workers; then only
    their decode workers (a failure does not say which side of a pair broke)."""
    every = frozenset().union(*(r.workers for r in failed))
    prefill = frozenset(r.prefill for r in failed if r.prefill is not None)
    decode = frozenset(r.decode for r in failed)
    out: list[frozenset[str]] = []
    for ex in (every, prefill, decode):
        if ex and ex not in out:
            out.append(ex)
    return out

"""Which route a retry takes (router/retry.py): pure, over a route function given as a table."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cluster.cluster import NoWorkerError
from cluster.routing import Route
from router.retry import retry_exclusions, retry_route


def test_retry_exclusions_strictest_first() -> None:
    assert retry_exclusions([Route("d1", "p1")]) == [{"d1", "p1"}, {"p1"}, {"d1"}]
    assert retry_exclusions([Route("d1", "p1"), Route("d1", "p2")]) == [{"d1", "p1", "p2"}, {"p1", "p2"}, {"d1"}]
    assert retry_exclusions([Route("c1")]) == [{"c1"}]
    assert retry_exclusions([]) == []


def by_exclusion(table: dict[frozenset[str], Route]) -> Callable[[frozenset[str]], Route]:
    def route(exclude: frozenset[str]) -> Route:
        if exclude not in table:
            raise NoWorkerError("none")
        return table[exclude]

    return route


def test_a_retry_takes_an_untried_pair_then_one_pool_whole_then_a_suspect() -> None:
    failed = [Route("d1", "p1")]
    whole_p1 = Route("p1", local=True, fallback=True)
    local_d1 = Route("d1", local=True)
    pair = Route("d2", "p1")
    table = {frozenset({"d1", "p1"}): whole_p1, frozenset({"p1"}): local_d1, frozenset({"d1"}): pair}
    # strictest exclusion first; the first untried pair-like route with no suspect is taken
    assert retry_route(by_exclusion(table), failed, frozenset()) == local_d1
    # d1 named by the failure: a pair that avoids it wins; without one, one pool whole, not d1
    assert retry_route(by_exclusion(table), failed, frozenset({"d1"})) == pair
    del table[frozenset({"d1"})]
    assert retry_route(by_exclusion(table), failed, frozenset({"d1"})) == whole_p1
    # what was tried is never taken again, and nothing left raises
    with pytest.raises(NoWorkerError):
        retry_route(by_exclusion({frozenset({"p1"}): Route("d1", "p1")}), failed, frozenset())

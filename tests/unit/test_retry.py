"""Which route a retry takes (router/retry.py), and which worker a failure names for it
(cluster.handoff.blamed): pure, over a route function given as a table."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cluster.cluster import NoWorkerError
from cluster.handoff import blamed
from cluster.routing import Route
from kv_transfer.errors import ChunkRejected, PeerUnavailable, TransferAborted, TransferTimeout
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


def test_a_prefill_that_lost_its_decode_peer_names_the_peer_and_the_retry_avoids_it() -> None:
    # the one decode worker d1 was killed while p1 pushed a prompt's KV to it: p1's call fails
    # with the transfer's error, which names d1, so the retry runs the request whole on p1
    for lost in (PeerUnavailable("Stream removed"), TransferTimeout("stalled")):
        assert blamed(lost, None, peer="d1") == "d1"
    assert blamed(TransferAborted("cancelled"), None, peer="d1") is None  # the prefill side stopped it
    assert blamed(ChunkRejected("not_found", "no reservation"), "p1", peer="d1") == "d1"  # d1 lost it
    assert blamed(ChunkRejected("bad_dtype", "bf16"), "p1", peer="d1") == "p1"  # a refusal on its merits
    assert blamed(RuntimeError("engine"), "p1", peer="d1") == "p1"
    assert blamed(PeerUnavailable("x"), "p1", peer=None) == "p1"
    failed = [Route("d1", "p1")]
    table = {frozenset({"p1"}): Route("d1", local=True, fallback=True), frozenset({"d1"}): Route("p1", fallback=True)}
    assert retry_route(
        by_exclusion(table), failed, frozenset({blamed(PeerUnavailable("x"), None, "d1") or ""})
    ) == Route("p1", fallback=True)

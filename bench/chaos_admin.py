"""The operator's scenario of `tandem bench chaos`: the pools resized, a worker drained and one
flipped while streams run, as an operator (or the autoscaler) does on a busy afternoon.

    wave 1  1P+2D   add a prefill worker                     -> 2P+2D
    wave 2  2P+2D   drain the busiest decode worker          -> 2P+2D (it is replaced)
    wave 3  2P+2D   flip a decode worker to prefill          -> 3P+1D
    wave 4  3P+1D   rebalance to 1P+2D (a prefill one flips) -> 1P+2D

Each wave sends the same streams; its action comes once a quarter of them are decoding. Every
stream must end with its undisturbed answer (greedy), the pools whole at 1P+2D, no block held.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from bench.chaos_client import Stream, run_streams
from bench.chaos_harness import Chaos, ScenarioResult, outcome, same_answers, until
from bench.chaos_scenarios import busiest_decoder, decoding


def admin_churn(c: Chaos, n: int = 16) -> ScenarioResult:
    c.pools(prefill=1, decode=2)
    client = c.client.without_speculation()
    prompts = c.prompts(n, "admin-churn")
    base = run_streams(client, prompts)

    def add_a_prefiller() -> str:
        c.cluster.scale("prefill", 2)
        return "added a prefill worker"

    def rebalance() -> str:
        c.cluster.resize({"prefill": 1, "decode": 2})  # one write: a prefill worker flips, one stops
        return "rebalanced to 1P+2D"

    def flip_a_decoder() -> str:
        worker = c.workers("decode")[0]
        if not c.cluster.flip(worker, "prefill"):
            raise RuntimeError(f"the pool manager refused to flip {worker}")
        return f"flipped {worker} to prefill"

    waves: list[tuple[Callable[[], str], dict[str, int]]] = [
        (add_a_prefiller, {"prefill": 2, "decode": 2}),
        (lambda: f"drained {_drained(c, busiest_decoder(c))}", {"prefill": 2, "decode": 2}),
        (flip_a_decoder, {"prefill": 3, "decode": 1}),
        (rebalance, {"prefill": 1, "decode": 2}),
    ]
    runs: list[Stream] = []
    done: list[str] = []
    t_last = 0.0
    for action, after in waves:

        def during(streams: list[Stream], action: Callable[[], str] = action) -> None:
            nonlocal t_last
            until(lambda: decoding(streams) >= n // 4, 120, "streams under way")
            t_last = time.monotonic()
            done.append(action())

        runs += run_streams(client, prompts, during)
        c.pools(**after)
    facts = {**same_answers(base * len(waves), runs, client.max_tokens), "actions": done}
    recovery = c.whole_again(t_last, prefill=1, decode=2)
    return outcome("pools resized, drained, flipped", base, runs, runs, recovery_s=recovery,
                   held_blocks=c.held_after_idle(), facts=facts)  # fmt: skip


def _drained(c: Chaos, worker: str) -> str:
    if not c.cluster.drain(worker):
        raise RuntimeError(f"the pool manager did not drain {worker}")
    return worker

"""The fault scenarios of `tandem bench chaos`, on a live cluster behind the real router, with
real process kills (the control plane's in bench/chaos_control.py). The integration test runs
these same functions and asserts on their results.

Each scenario measures its load undisturbed first (the reference texts, and the latency the
fault's cost is measured against), then again with the fault, and reports a ScenarioResult.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable

import httpx

from bench.chaos_client import ChatClient, Stream, run_streams
from bench.chaos_control import manager_kill, redis_kill, second_router
from bench.chaos_harness import Chaos, ScenarioResult, outcome, same_answers, until
from bench.harness import serving
from bench.stats import percentile


def decode_kill(c: Chaos, n: int = 32) -> ScenarioResult:
    """2 decode workers, n streams; SIGKILL the busier one once a quarter of them are decoding.
    The streams opt out of speculation (see `decoding`)."""
    c.pools(prefill=1, decode=2)
    client = c.client.without_speculation()
    prompts = c.prompts(n, "decode-kill")
    base = run_streams(client, prompts)
    split = Counter(s.decode_worker for s in base)
    t_fault = 0.0

    def fault(streams: list[Stream]) -> None:
        nonlocal t_fault
        until(lambda: decoding(streams) >= n // 4, 120, "streams under way")
        t_fault = _kill(c, busiest_decoder(c))

    run = run_streams(client, prompts, fault)
    facts = {**same_answers(base, run, client.max_tokens), "burst_split": sorted(split.values())}
    affected = [s for s in run if int(s.timing.get("migrations", 0)) > 0]
    recovery = c.whole_again(t_fault, prefill=1, decode=2)
    return outcome("decode SIGKILL", base, run, affected, recovery_s=recovery, held_blocks=c.held_after_idle(),
                   facts=facts)  # fmt: skip


def decoding(streams: list[Stream]) -> int:
    """Streams past their fourth token and not yet ended.

    A decode fault needs streams mid-decode on its victim. With suffix speculation, 32 tokens of
    these similar stories came in ~0.5 s per stream (a burst of 32: 16-22 decoding at once at
    most), and in the project's CI every stream of the killed worker had ended or not begun at
    the kill: none moved. So the decode-fault scenarios' streams opt out of speculation (~2 s
    each; a migration with speculation on is tested in test_cluster), and the fault waits for a
    quarter of them to be mid-decode: waiting for half, 1 run in ~10 never saw that many at once."""
    return sum(len(s.token_times) >= 4 and not s.done for s in streams)


def busiest_decoder(c: Chaos) -> str:
    """The decode worker whose engine runs the most streams now. Not the router's in-flight
    count: that also holds streams still in prefill for it, and a CI run froze a worker whose 8
    streams had not reached it yet while the quarter under way ran on the other (none moved)."""
    stats = c.stats()
    return max(c.workers("decode"), key=lambda d: int(stats.get(d, {}).get("running", 0)))


def only_decode_kill(c: Chaos, n: int = 8) -> ScenarioResult:
    """1P+1D, n streams; SIGKILL the one decode worker once half are going, while a long prompt's
    prefill streams its KV to it: with no other decode worker, the streams finish whole on the
    prefill worker (RoutingPolicy.cross_pool), the long prompt is retried there (its prefill
    lost its peer: the failure names the dead worker, cluster.handoff.blamed), and a request sent
    right after is served there too while the pool manager replaces the dead worker.

    The n streams opt out of speculation: the decode worker's suffix tree holds their undisturbed
    answers, and with it their 32 tokens took ~4 steps, so the kill, which waits for the long
    prompt's prefill, came after all of them had ended (int8, suffix: 1 of 6 runs looked at)."""
    c.pools(prefill=1, decode=1)
    client = c.client.without_speculation()
    prompts = c.prompts(n, "only-decode-kill")
    long_prompt = c.prompts(1, "only-decode-kill-long", words=300)[0]
    base = run_streams(client, prompts)
    probe: list[Stream] = []
    mid_push = Stream(long_prompt)
    t_fault = 0.0

    def fault(streams: list[Stream]) -> None:
        nonlocal t_fault
        until(lambda: sum(len(s.token_times) >= 4 for s in streams) >= n // 2, 120, "streams under way")
        pushing = threading.Thread(target=c.client.stream, args=(long_prompt, mid_push), daemon=True)
        pushing.start()
        prefill = c.workers("prefill")[0]
        until(lambda: c.cluster.ledger.load(prefill).prefill_tokens >= 256, 60, "the long prompt's prefill")
        time.sleep(0.1)  # into the prompt, with layers on the wire
        t_fault = _kill(c, c.workers("decode")[0])
        probe.append(c.client.stream("A new request while the decode pool is empty: say hello."))
        pushing.join()

    run = run_streams(client, prompts, fault)
    affected = [s for s in run if int(s.timing.get("migrations", 0)) > 0]
    facts = {
        **same_answers(base, run, client.max_tokens),
        "new_request_ok": probe[0].completed,
        "mid_push_attempts": int(mid_push.timing.get("attempts", 0)),
    }
    recovery = c.whole_again(t_fault, prefill=1, decode=1)
    again = c.client.stream(long_prompt)  # its reference; run before the fault, it would have left the prompt cached
    facts["mid_push_same_text"] = mid_push.completed and again.completed and mid_push.text == again.text
    return outcome("only decode SIGKILL (1P+1D)", base, run, affected, recovery_s=recovery,
                   held_blocks=c.held_after_idle(), facts=facts)  # fmt: skip


def prefill_kill(c: Chaos, n: int = 8) -> ScenarioResult:
    """2 prefill workers, n long prompts; SIGKILL one while it is prefilling and streaming KV."""
    return _prefill_fault(c, n, "prefill-kill", "prefill SIGKILL", lambda worker: _kill(c, worker))


def prefill_stop(c: Chaos, n: int = 8, stop_s: float = 15.0) -> ScenarioResult:
    """2 prefill workers, n long prompts; SIGSTOP one while it prefills and streams KV (a long GC
    pause, a stalled VM), for `stop_s`, then SIGCONT. Its prompts are retried on the other worker
    before it wakes; what it finishes after waking goes nowhere and frees its blocks."""
    return _prefill_fault(c, n, "prefill-stop", "prefill SIGSTOP", lambda worker: _freeze(c, worker, stop_s))


def _prefill_fault(c: Chaos, n: int, tag: str, name: str, fault_on: Callable[[str], float]) -> ScenarioResult:
    """`fault_on(worker)` (returning when the fault hit) for one of 2 prefill workers while it
    prefills n long prompts.

    The faulted run meets caches that do not hold its prompts: run after an undisturbed run of
    the same prompts, every prompt was a prefix-cache hit on the worker that had prefilled it
    (int8 here), nothing was in flight at the fault, and no prefill was retried. So the
    undisturbed run (for latency) has prompts of its own, and the reference texts are those
    same prompts run again once the pools are whole."""
    c.pools(prefill=2, decode=1)
    prompts = c.prompts(n, tag, words=300)
    base = run_streams(c.client, c.prompts(n, f"{tag}-base", words=300))
    t_fault = 0.0

    def fault(streams: list[Stream]) -> None:
        nonlocal t_fault
        until(lambda: queued()[0][1] > 0, 60, "a prefill in flight")
        time.sleep(0.2)  # into the prompt, with layers on the wire
        t_fault = fault_on(queued()[0][0])

    def queued() -> list[tuple[str, int]]:
        """The prefill workers, the most prefill tokens queued on them first: the one with the
        first prefill in flight may have had one short prompt, done within the 0.2 s (the
        burst is not split evenly: cache-aware routing), and the fault then hit nothing."""
        loads = [(p, c.cluster.ledger.load(p).prefill_tokens) for p in c.workers("prefill")]
        return sorted(loads, key=lambda pl: -pl[1]) or [("", 0)]

    run = c.streamed_with(prompts, fault)
    affected = [s for s in run if int(s.timing.get("attempts", 1)) > 1 or int(s.timing.get("migrations", 0))]
    recovery = c.whole_again(t_fault, prefill=2, decode=1)
    facts = same_answers(run_streams(c.client, prompts), run, c.client.max_tokens)
    facts["attempts"] = sorted(int(s.timing.get("attempts", 0)) for s in run)
    facts["retried"] = len(affected)
    facts["affected_stall_max_s"] = max((stalled_after(s, t_fault) for s in affected), default=0.0)
    return outcome(name, base, run, affected, recovery_s=recovery, held_blocks=c.held_after_idle(), facts=facts)


def _kill(c: Chaos, worker: str) -> float:
    """SIGKILL `worker`; when (monotonic)."""
    c.signal(worker, signal.SIGKILL)
    return time.monotonic()


def _freeze(c: Chaos, worker: str, stop_s: float) -> float:
    """SIGSTOP `worker` for `stop_s`, then SIGCONT it; when it stopped (monotonic)."""
    pid = c.signal(worker, signal.SIGSTOP)
    stopped = time.monotonic()
    time.sleep(stop_s)
    with contextlib.suppress(ProcessLookupError):  # the pool manager may have killed it: also fine
        os.kill(pid, signal.SIGCONT)
    return stopped


def stalled_after(s: Stream, t: float) -> float:
    """The longest the stream went without a token from t on (t to its first token, or between
    two, or to its end): how long a fault at t held it. Not the wait for its first token after
    t: a frozen worker's tokens already on their way arrive a few ms after it (0.00 s measured
    so, for streams that then waited seconds to move)."""
    times = [t, *(x for x in s.token_times if x > t), max(s.end, t)]
    return max(b - a for a, b in itertools.pairwise(times))


def decode_stop(c: Chaos, n: int = 16, stop_s: float = 15.0) -> ScenarioResult:
    """2 decode workers, n streams; SIGSTOP the busier one for `stop_s`, then SIGCONT. The
    streams opt out of speculation (see `decoding`)."""
    c.pools(prefill=1, decode=2)
    client = c.client.without_speculation()
    prompts = c.prompts(n, "decode-stop")
    base = run_streams(client, prompts)
    victim = ""
    t_fault = 0.0

    def fault(streams: list[Stream]) -> None:
        nonlocal victim, t_fault
        until(lambda: decoding(streams) >= n // 4, 120, "streams under way")
        victim = busiest_decoder(c)
        t_fault = _freeze(c, victim, stop_s)

    run = run_streams(client, prompts, fault)
    others = [s.tpot for s in run if s.decode_worker != victim and not s.timing.get("migrations") and s.tpot]
    undisturbed = [s.tpot for s in base if s.tpot]
    affected = [s for s in run if int(s.timing.get("migrations", 0)) > 0]
    facts = {
        **same_answers(base, run, client.max_tokens),
        "others_tpot_ratio": percentile(others, 50) / percentile(undisturbed, 50) if others and undisturbed else 0.0,
        "affected_max_s": max((s.e2e for s in affected), default=0.0),
        # each moved stream's longest wait for a token after the freeze: under stop_s, it moved
        # before the worker woke (e2e also counts the stream's tokens before the freeze: a slow CPU's)
        "affected_stall_max_s": max((stalled_after(s, t_fault) for s in affected), default=0.0),
    }
    recovery = c.whole_again(t_fault, prefill=1, decode=2)
    return outcome("decode SIGSTOP", base, run, affected, recovery_s=recovery, held_blocks=c.held_after_idle(),
                   facts=facts)  # fmt: skip


def disconnects(c: Chaos) -> ScenarioResult:
    """A client hangs up while queued in the router, then one during its prefill: the slot and
    every block come back within a second."""
    c.pools(prefill=1, decode=1)
    with serving(c.cluster, max_running=1) as url:
        one = ChatClient(url, c.client.model, 64)
        first = Stream("holder")
        holder = threading.Thread(target=one.stream, args=("Tell me a long story.", first), daemon=True)
        holder.start()
        until(lambda: len(first.token_times) > 0, 60, "the first stream's tokens")
        hang_up = one.hang_up_later("Queued: say hi.")
        until(lambda: _waiting(url) == 1, 10, "a queued request")
        hang_up()
        queued_freed_s = until(lambda: _waiting(url) == 0, 10, "the queue slot back")
        holder.join(120)
    prefilling = c.workers("prefill")

    def queued_prefill() -> int:  # the router's own count: asking a worker would wait for its step
        return sum(c.cluster.ledger.load(p).prefill_tokens for p in prefilling)

    hang_up = c.client.hang_up_later(c.prompts(1, "disconnect", words=1600)[0])
    until(lambda: len(c.cluster.ledger) == 1 and queued_prefill() > 0, 30, "the prefill under way")
    time.sleep(0.5)  # into the prompt's compute, with its first layers on the wire
    in_prefill = queued_prefill() > 0
    hang_up()
    t_fault = time.monotonic()
    freed_s = until(lambda: c.held_blocks() == 0 and len(c.cluster.ledger) == 0, 30, "blocks back", 0.02)
    facts = {"queued_slot_freed_s": queued_freed_s, "prefill_blocks_freed_s": freed_s, "hung_up_in_prefill": in_prefill}
    return ScenarioResult("client disconnects", 2, 0, 0, 0, 0.0, time.monotonic() - t_fault, c.held_after_idle(),
                          facts)  # fmt: skip


def _waiting(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("tandem:num_requests_waiting"):
            return int(float(line.split()[-1]))
    return 0


SCENARIOS: dict[str, Callable[[Chaos], ScenarioResult]] = {
    "decode-kill": decode_kill,
    "only-decode-kill": only_decode_kill,
    "prefill-kill": prefill_kill,
    "decode-stop": decode_stop,
    "prefill-stop": prefill_stop,
    "redis-kill": redis_kill,
    "manager-kill": manager_kill,
    "second-router": second_router,
    "disconnect": disconnects,
}

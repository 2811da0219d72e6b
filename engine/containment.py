"""Containment: a step that raises fails the request that set it off, not every request in it.

A bug one request sets off (its grammar, its penalties, its sampling, a kernel on its shape) used
to fail every stream on the worker, and each of those, replayed elsewhere (cluster/request_run.py),
carried the bad one along to fail a second worker's streams and a third's. Now:

    step {a, b, c} raises   ->  a, b, c suspects: each runs alone, one step each
      a alone: passes   ->  cleared, back in the batch
      b alone: raises   ->  b fails (its stream gets the error); nothing else does
      c alone: passes   ->  cleared; the batch runs on as before

A request fails at once where it ran alone, or when it was in MAX_STRIKES failed steps (a fault
that only some mix of requests sets off, where every one passes alone). The KV a failed step
wrote for positions it had not computed is written again when they run: nothing advanced. A
prefill hand-off's chunk is streamed again whole (kv_transfer/streaming.py).

An exception in one request's share of the step's post-processing (its tokens appended,
detokenized, stop-checked) fails that request only (`Engine.step`).
"""

from __future__ import annotations

from collections.abc import Collection

from engine.outputs import RequestOutput
from engine.request import Request
from engine.scheduler import SchedulerOutput

MAX_STRIKES = 3


class Quarantine:
    """The requests of failed steps: `suspects` run alone (Scheduler.schedule's `alone`) until each
    passes a step or fails one."""

    def __init__(self, max_strikes: int = MAX_STRIKES) -> None:
        self.max_strikes = max_strikes
        self.suspects: set[str] = set()
        self._strikes: dict[str, int] = {}

    def step_failed(self, out: SchedulerOutput) -> list[Request]:
        """The requests of the failed step `out` to fail now; the others become suspects."""
        reqs = [c.request for c in out.chunks]
        fail = []
        for req in reqs:
            rid = req.request_id
            self._strikes[rid] = strikes = self._strikes.get(rid, 0) + 1
            if len(reqs) == 1 or strikes >= self.max_strikes:
                fail.append(req)
                self.forget(rid)
            else:
                self.suspects.add(rid)
        return fail

    def step_passed(self, out: SchedulerOutput) -> None:
        """A step ran: a suspect that ran alone is cleared (its strikes stay, for the next mix)."""
        if len(out.chunks) == 1:
            self.suspects.discard(out.chunks[0].request.request_id)

    def live(self, requests: Collection[str]) -> set[str]:
        """The suspects among `requests`; those not in it (finished, aborted) are forgotten."""
        if self._strikes:
            self.suspects = {r for r in self.suspects if r in requests}
            for rid in [r for r in self._strikes if r not in requests]:
                del self._strikes[rid]
        return self.suspects

    def forget(self, request_id: str) -> None:
        self.suspects.discard(request_id)
        self._strikes.pop(request_id, None)


def failed_output(req: Request, e: BaseException) -> RequestOutput:
    """The last output of a request that an exception in a step ended: its stream gets `error`."""
    return RequestOutput(
        request_id=req.request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="error",
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        error=f"the engine failed on this request: {type(e).__name__}: {e}",
    )

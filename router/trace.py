"""One request's trace: where its time went (the timing breakdown clients and logs see) and what
it used, from arrival to its last token."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from cluster.outputs import Placement
from engine.spans import TraceContext
from router.tracing import request_context


@dataclass
class Trace:
    """Where one request's time went and what it used (monotonic clock); one per HTTP request."""

    request_id: str
    endpoint: str
    stream: bool = False
    priority: int = 0
    user: str | None = None
    t_arrival: float = field(default_factory=time.monotonic)
    router_queue_s: float = 0.0
    t_dispatch: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0
    placement: Placement | None = None
    engine_ids: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    migrations: int = 0
    spec_draft_tokens: int = 0  # speculative decoding: draft tokens verified, and accepted
    spec_accepted_tokens: int = 0
    status: int = 200
    error: str | None = None
    recorded: bool = False
    client: TraceContext | None = None  # the client's W3C trace context, if it sent one
    context: TraceContext = field(init=False)  # the request's root span (router.tracing)

    def __post_init__(self) -> None:
        self.context = request_context(self.request_id, self.client)

    def timing(self) -> dict[str, Any]:
        """queue (router + worker), route, prefill, transfer, first decode (transfer done to first
        token back here), decode (first to last token), plus TTFT, E2E and where it ran. The parts
        up to first decode sum to the TTFT."""
        p = self.placement or Placement("", "")
        worker_queue, prefill, transfer = p.queue_s, p.prefill_s, p.transfer_s
        end = self.t_last or time.monotonic()
        first = self.t_first or end
        dispatch = self.t_dispatch or first
        out = {
            "queue_s": self.router_queue_s + worker_queue,
            # admission to the last attempt's dispatch: routing (the prefix index), failed attempts
            "route_s": max(0.0, dispatch - self.t_arrival - self.router_queue_s),
            "prefill_s": prefill,
            "transfer_s": transfer,
            "first_decode_s": max(0.0, first - dispatch - worker_queue - prefill - transfer),
            "decode_s": end - first,
            "ttft_s": first - self.t_arrival,
            "e2e_s": end - self.t_arrival,
        }
        return {
            **{k: round(v, 6) for k, v in out.items()},
            "prefill_worker": p.prefill_worker or None,
            "decode_worker": p.decode_worker or None,
            "cached_tokens": p.cached_tokens,
            "transfer_bytes": p.transfer_bytes,
            "transfer_gbps": round(p.transfer_gbps, 3),
            "attempts": len(self.engine_ids),
            "migrations": self.migrations,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
        }

    def log_line(self) -> str:
        skip = ("placement", "recorded", "client", "context")
        fields = {k: v for k, v in asdict(self).items() if not k.startswith("t_") and k not in skip}
        trace_id = f"{self.context.trace_id:032x}"
        return json.dumps({"event": "request", **fields, "trace_id": trace_id, "timing": self.timing()}, default=str)

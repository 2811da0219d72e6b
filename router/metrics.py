"""Prometheus metrics on the router's own registry, named after vLLM's where vLLM has one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cluster.outputs import Placement

P = "tandem:"
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_BYTES = tuple(float(4**i * 1024) for i in range(12))  # 1 KiB .. 4 GiB
_GBPS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 400.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(f"{P}time_to_first_token_seconds", "Time to first token.", registry=r, buckets=_LATENCY)
        self.itl = Histogram(
            f"{P}inter_token_latency_seconds", "Time between output tokens.", registry=r, buckets=_LATENCY
        )
        self.e2e = Histogram(
            f"{P}e2e_request_latency_seconds", "Request latency, arrival to last token.", registry=r, buckets=_LATENCY
        )
        self.queue_time = Histogram(
            f"{P}request_queue_time_seconds", "Time waiting in the router's admission queue.", registry=r
        )
        self.prefill_time = Histogram(
            f"{P}request_prefill_time_seconds", "Prefill time on the prefill worker.", registry=r, buckets=_LATENCY
        )
        self.running = Gauge(f"{P}num_requests_running", "Requests admitted to the workers.", registry=r)
        self.waiting = Gauge(f"{P}num_requests_waiting", "Requests in the admission queue.", registry=r)
        self.kv_usage = Gauge(
            f"{P}kv_cache_usage_perc", "KV-cache usage per worker (1 = full).", ["worker", "role"], registry=r
        )
        self.prompt_tokens = Counter(f"{P}prompt_tokens", "Prefill tokens processed.", registry=r)
        self.generation_tokens = Counter(f"{P}generation_tokens", "Generated tokens.", registry=r)
        self.cached_tokens = Counter(f"{P}prefix_cache_hit_tokens", "Prompt tokens served from a cache.", registry=r)
        self.success = Counter(
            f"{P}request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.rejected = Counter(f"{P}request_rejected", "Requests answered with an error.", ["status"], registry=r)
        self.retries = Counter(f"{P}request_retries", "Retries on another worker pair.", registry=r)
        self.transfer_bytes = Histogram(
            f"{P}kv_transfer_bytes", "KV bytes moved per request.", registry=r, buckets=_BYTES
        )
        self.transfer_seconds = Histogram(
            f"{P}kv_transfer_seconds", "KV transfer time per request.", registry=r, buckets=_LATENCY
        )
        self.transfer_gbps = Histogram(
            f"{P}kv_transfer_gbps", "KV transfer throughput per request (GB/s).", registry=r, buckets=_GBPS
        )

        self.preemptions = Gauge(f"{P}num_preemptions", "Requests preempted for KV room, to be recomputed "
                                 "(running total, from the worker's heartbeat).", ["worker"], registry=r)  # fmt: skip
        # speculative decoding, per worker (running totals read from its heartbeat; vLLM's names)
        spec = {
            "spec_decode_num_drafts": "Drafts verified.",
            "spec_decode_num_draft_tokens": "Draft tokens verified.",
            "spec_decode_num_accepted_tokens": "Draft tokens accepted.",
        }
        self.spec = {k: Gauge(f"{P}{k}", doc, ["worker"], registry=r) for k, doc in spec.items()}
        self.spec_per_pos = Gauge(f"{P}spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by position in the draft.", ["worker", "position"],
                                  registry=r)  # fmt: skip

    def observe_first(self, p: Placement) -> None:
        """The first token's breakdown: prefill time, prefix hit, and the KV transfer if any."""
        self.prefill_time.observe(p.prefill_s)
        self.cached_tokens.inc(p.cached_tokens)
        if p.transfer_bytes <= 0:
            return  # a colocated run moved nothing
        self.transfer_bytes.observe(float(p.transfer_bytes))
        self.transfer_seconds.observe(p.transfer_seconds)
        self.transfer_gbps.observe(p.transfer_gbps)

    def set_workers(self, workers: Sequence[dict[str, Any]]) -> None:
        self.kv_usage.clear()
        for g in (*self.spec.values(), self.spec_per_pos, self.preemptions):
            g.clear()
        for w in workers:
            wid = str(w.get("worker_id"))
            if "kv_usage" in w:
                self.kv_usage.labels(wid, str(w.get("role"))).set(float(w["kv_usage"]))
            if "num_preemptions" in w:
                self.preemptions.labels(wid).set(float(w["num_preemptions"]))
            for k, g in self.spec.items():
                if k in w:
                    g.labels(wid).set(float(w[k]))
            for pos, n in enumerate(w.get("spec_decode_num_accepted_tokens_per_pos") or []):
                self.spec_per_pos.labels(wid, str(pos)).set(float(n))

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""RouterSettings: the router's service configuration (pydantic, validated at the edge)."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.routing import RoutingPolicy

RUNNING_PER_WORKER = 64  # requests in the backend for each decode or colocated worker up


class RouterSettings(BaseModel):
    """How the router listens, admits, retries and authenticates. Frozen once built.

    max_running requests run in the backend at once (None: RUNNING_PER_WORKER for each worker up
    that runs streams, as pools grow and shrink); beyond that up to max_waiting wait per
    priority level (max_waiting_total in all) for at most queue_timeout_s; past either bound
    the router answers 429 with Retry-After. admin_token None disables the admin API (403)
    unless allow_loopback_admin and the caller is on loopback. Non-empty api_keys make /v1 ask
    for `Authorization: Bearer <key>`. A request body over max_body_bytes gets a 413 before it is
    read whole. A request's `priority` is clamped into [min_priority, max_priority] (lower runs
    first), so a client cannot jump the queue further than the operator allows.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    model_name: str = ""  # "" = the backend's name for its model
    max_running: int | None = Field(default=None, ge=1)
    # A burst queues, as vLLM's and SGLang's do, rather than being refused: 64 waiting (256 in all)
    # and 30 s had a load generator's 1,000 requests sent at once answered 872 times with a 429.
    # The bounds keep memory bounded (a waiting request holds its body and prompt ids, ~0.3 MB
    # for 8K tokens); the wait is what the OpenAI SDK itself waits for an answer by default.
    max_waiting: int = Field(default=2048, ge=0)
    max_waiting_total: int = Field(default=4096, ge=0)
    queue_timeout_s: float = Field(default=600.0, gt=0)
    retry_after_s: int = Field(default=1, ge=1)
    max_attempts: int = Field(default=2, ge=1, le=5)
    # max_tokens where a request leaves it out; None: each API's own default, as OpenAI and vLLM
    # have it (chat: the rest of the context; completions: 16)
    default_max_tokens: int | None = Field(default=None, ge=1)
    admin_token: str | None = None
    allow_loopback_admin: bool = False
    api_keys: tuple[str, ...] = ()
    max_replicas: int = Field(default=64, ge=1)
    colocate_below_tokens: int = Field(default=0, ge=0)
    local_below_tokens: int = Field(default=RoutingPolicy.local_below_tokens, ge=0)  # see RoutingPolicy
    overflow_below_tokens: int = Field(default=RoutingPolicy.overflow_below_tokens, ge=0)  # see RoutingPolicy
    spill_streams: int = Field(default=RoutingPolicy.spill_streams, ge=0)  # see RoutingPolicy
    cross_pool: bool = RoutingPolicy.cross_pool  # see RoutingPolicy
    # a chat's earlier answers run as decode rows, as they were written (SamplingParams.decoded):
    # a turn then answers alike with its history cached or not; False prefills them, faster cold
    # (SamplingParams.decoded_as_prompt; they are marked all the same, so a warm turn reuses them)
    exact_history: bool = True
    max_body_bytes: int = Field(default=2 * 1024 * 1024, ge=1024)
    min_priority: int = -100
    max_priority: int = 100

    @property
    def routing_policy(self) -> RoutingPolicy:
        """The cluster's routing policy these settings ask for."""
        return RoutingPolicy(
            colocate_below_tokens=self.colocate_below_tokens,
            local_below_tokens=self.local_below_tokens,
            overflow_below_tokens=self.overflow_below_tokens,
            spill_streams=self.spill_streams,
            cross_pool=self.cross_pool,
        )

    @model_validator(mode="after")
    def _priority_range(self) -> RouterSettings:
        if self.min_priority > self.max_priority:
            raise ValueError(f"min_priority ({self.min_priority}) must be <= max_priority ({self.max_priority})")
        return self

    def running_bound(self, serving_workers: int) -> int:
        """Requests the router runs at once, with `serving_workers` decode or colocated workers up."""
        return self.max_running or RUNNING_PER_WORKER * max(serving_workers, 1)

    def clamp_priority(self, priority: int) -> int:
        return min(max(priority, self.min_priority), self.max_priority)

    @classmethod
    def from_env(cls, **overrides: Any) -> RouterSettings:
        """Settings with TANDEM_ADMIN_TOKEN and TANDEM_API_KEYS (comma-separated) read from the environment."""
        env: dict[str, Any] = {}
        if os.environ.get("TANDEM_ADMIN_TOKEN"):
            env["admin_token"] = os.environ["TANDEM_ADMIN_TOKEN"]
        keys = tuple(k.strip() for k in os.environ.get("TANDEM_API_KEYS", "").split(",") if k.strip())
        if keys:
            env["api_keys"] = keys
        return cls(**{**env, **overrides})

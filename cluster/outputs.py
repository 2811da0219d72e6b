"""What the cluster hands the router for one request: frozen values, no dicts.

StreamOutput   new tokens (and text, logprobs) of one step; the first carries a Placement,
               the finished one the number of migrations (cluster.request_run)
Placement      where the first token was made and what it cost: the TTFT breakdown
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.messages import TokenOutput
from kv_transfer.stats import TransferStats


@dataclass(frozen=True)
class Placement:
    """The workers of a request's first attempt, its prefix-cache hit, and where the time to its
    first token went on the workers (queue, prefill, KV transfer) and what moved."""

    prefill_worker: str
    decode_worker: str
    cached_tokens: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0

    @property
    def transfer_gbps(self) -> float:
        return self.transfer_bytes / self.transfer_seconds / 1e9 if self.transfer_seconds > 0 else 0.0

    @classmethod
    def of(
        cls, prefill: str, decode: str, cached: int, times: tuple[float, float, float], moved: TransferStats
    ) -> Placement:
        return cls(prefill, decode, cached, *times, moved.bytes, moved.seconds)


@dataclass(frozen=True, kw_only=True)  # its own fields by name: TokenOutput may grow
class StreamOutput(TokenOutput):
    """A step's news for one request, as the client sees it: `num_prompt_tokens` is the client's
    prompt and `num_output_tokens` counts every output token so far, across migrations; the
    first carries a Placement, the finished one the number of migrations."""

    placement: Placement | None = None
    migrations: int = 0

    @classmethod
    def of_token(cls, out: TokenOutput, placement: Placement | None = None, migrations: int = 0) -> StreamOutput:
        return cls(**vars(out), placement=placement, migrations=migrations)

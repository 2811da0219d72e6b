"""A request's state inside one engine: its tokens, progress and status."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from engine.sampling_params import SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Owned by the scheduler. `token_ids` is prompt + output; `num_computed_tokens` of them have KV."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_seq: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    draft: tuple[int, ...] = ()  # tokens to verify in the next step (engine/speculation.py)
    num_draft_tokens: int = 0  # draft tokens verified so far, and accepted
    num_accepted_tokens: int = 0
    hands_off: bool = False  # a prefill engine's: it stops at its first token, its blocks held for the transfer

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: priority, then arrival (FCFS within a priority)."""
        return (self.params.priority, self.arrival_seq)

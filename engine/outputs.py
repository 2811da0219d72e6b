"""What the engine hands back: one RequestOutput per request per step with news."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's logprob under the model and the top-N alternatives, highest first;
    `rank`: the token's place in the vocabulary by logprob (1: the likeliest), where scored (a
    prompt's tokens: vLLM's `prompt_logprobs` report it)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int | None = None


@dataclass(frozen=True)
class KVHandoff:
    """A prefill-role request's KV, held in `block_ids` until `Engine.release(request_id)`.

    The blocks hold the KV of the first `num_tokens` tokens (the prompt); the first
    generated token's KV is not computed yet.
    """

    block_ids: list[int]
    num_tokens: int


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "prefill_done" | "error"
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # with the first token, where asked: prompt tokens 1..n-1
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    kv: KVHandoff | None = None
    queue_s: float = 0.0  # arrival to first scheduled (time.monotonic based)
    num_draft_tokens: int = 0  # speculation so far (engine/speculation.py): draft tokens verified
    num_accepted_tokens: int = 0  # ... and accepted
    error: str | None = None  # why the engine failed on it (finish_reason "error", engine/containment.py)


@dataclass
class Completion:
    """The whole result of one offline request (Engine.generate)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    num_cached_tokens: int = 0

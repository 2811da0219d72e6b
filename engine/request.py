"""A request's state inside one engine: its tokens, progress and status; its prompt, checked."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from engine.cache_keys import DECODE_ROW, SALTED, cache_keys, decode_from
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer


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
    # engine/prompt_logprobs.py: prompt_logprobs[i] scores prompt token i + 1, once computed
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list, repr=False)
    grammar: Any = field(default=None, repr=False)  # a guided request's matcher (engine/grammar.py)
    hands_off: bool = False  # a prefill engine's: it stops at its first token, its blocks held for the transfer
    _keys: list[int] = field(default_factory=list, repr=False)  # cache_keys(), as far as computed

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
    def decode_from(self) -> int:
        """The first position whose KV a decode row computes: the prompt's end, less the outputs
        of earlier runs that it carries (`SamplingParams.output_offset`: a replay appends them to
        its prompt). Every position from here on runs as decode rows, whatever the step, so the
        KV of a replayed or recomputed answer is bit for bit the KV its decode steps wrote."""
        return decode_from(self.num_prompt_tokens, self.params)

    def cache_keys(self) -> list[int]:
        """`token_ids` as the prefix cache hashes them (engine/cache_keys.py), extended as the
        tokens grow; the caller does not change the list."""
        if not self._keys:
            self._keys = cache_keys(self.token_ids, self.num_prompt_tokens, self.params)
        elif len(self._keys) < len(self.token_ids):  # decoded outputs
            if self.params.cache_salt is not None and len(self._keys) < SALTED:  # salted too
                self._keys = cache_keys(self.token_ids, self.num_prompt_tokens, self.params)
            else:
                self._keys += [t | DECODE_ROW for t in self.token_ids[len(self._keys) :]]
        return self._keys

    def run_from(self, pos: int) -> tuple[bool, int]:
        """Whether position `pos` runs as decode rows (an answer's: from `decode_from` on, or in
        one of `params.decoded`), and where that run ends: the next position that runs the
        other way, or the end of the tokens."""
        if pos >= self.decode_from:
            return True, self.num_tokens
        for start, end in () if self.params.decoded_as_prompt else self.params.decoded:
            if pos < start:
                return False, min(start, self.decode_from)
            if pos < end:
                return True, min(end, self.decode_from)
        return False, self.decode_from

    def record_prompt_logprob(self, pos: int, logprob: TokenLogprob) -> None:
        """Prompt token `pos`'s logprob (1 <= pos < the prompt's length), as a step computed it."""
        if not self.prompt_logprobs:
            self.prompt_logprobs = [None] * (self.num_prompt_tokens - 1)
        self.prompt_logprobs[pos - 1] = logprob

    def scored_prompt(self) -> tuple[TokenLogprob, ...]:
        """Its prompt tokens' logprobs (from the second token on), or () where not all are computed
        (none asked for, or the prompt's KV came from elsewhere: the decode side of P/D)."""
        if not self.prompt_logprobs or any(lp is None for lp in self.prompt_logprobs):
            return ()
        return tuple(lp for lp in self.prompt_logprobs if lp is not None)

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


def checked_prompt(
    prompt: str | Sequence[int],
    params: SamplingParams,
    tokenizer: Tokenizer | None,
    vocab: int,
    max_model_len: int,
    cache_tokens: int,
) -> list[int]:
    """`prompt` as token ids, checked against the model (vocabulary, context) and the KV cache
    (`cache_tokens`: all its blocks' slots). Raises InvalidRequestError, PromptTooLongError."""
    params.validate_for_vocab(vocab)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer; pass token ids", "prompt")
        ids = tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
    if not ids:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if len(ids) >= max_model_len:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens; this model's context is {max_model_len} tokens", "prompt"
        )
    if len(ids) + 1 > cache_tokens:
        raise PromptTooLongError(f"the prompt ({len(ids)} tokens) does not fit the KV cache", "prompt")
    if len(ids) + params.max_tokens > min(max_model_len, cache_tokens):
        # one that outgrew the whole cache was preempted, and waited for room that never came
        total = f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens})"
        room = f"the context of {max_model_len}" if max_model_len <= cache_tokens else f"the KV cache's {cache_tokens}"
        raise InvalidRequestError(f"{total} exceeds {room} tokens", "max_tokens")
    return ids

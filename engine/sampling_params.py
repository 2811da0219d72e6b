"""Per-request sampling parameters, validated where they enter the engine."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.grammar import Guide

MAX_LOGIT_BIAS = 1024  # tokens one request may bias (each is work in every step it samples)
MAX_REPETITION_PENALTY = 10.0
MAX_BAD_WORDS = 256  # each is work in every step the request samples
MAX_BAD_WORD_TOKENS = 64
MAX_SALT_CHARS = 1024


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    temperature == 0 means greedy. top_k == 0 and min_p == 0 mean no cut. A `seed` makes the
    request's samples reproducible whatever else shares its batch, and identical whether
    the request runs on one engine or is split across a prefill and a decode engine:
    the random stream of output token i depends only on (seed, i).

    output_offset: how many output tokens came before this run of the request (a request
    replayed on another worker after a failure, with its emitted tokens appended to the
    prompt); its first token draws from (seed, output_offset), as it would have uninterrupted.

    decoded: spans [start, end) of prompt positions a decode wrote in an earlier turn (the
    conversation's earlier answers, as the router finds them in the chat template): they run as
    decode rows (engine/scheduler.py), so a turn's answer does not depend on whether the prefix
    cache still held those answers' KV. `decoded_as_prompt`: they run as prompt rows all the
    same (`tandem serve --fast-history`: a cold turn is faster, and may answer otherwise than a
    warm one), and still hash as decoded (engine/cache_keys.py).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # vLLM's: a token less likely than min_p x the likeliest's probability is cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's: the prompt tokens' logprobs with the top N at each position (engine/prompt_logprobs.py)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended it stays in the text
    priority: int = 0
    output_offset: int = 0
    speculate: bool = True  # False: no draft is verified for this request (engine/speculation.py)
    decoded: tuple[tuple[int, int], ...] = ()
    decoded_as_prompt: bool = False
    # engine/penalties.py: logit_bias as (token id, bias) pairs
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: only these may be sampled (none named: any)
    # vLLM's bad_words, as token ids (router/vllm_fields.py): none of these sequences is completed
    bad_words: tuple[tuple[int, ...], ...] = ()
    # vLLM's: the prefix cache finds this request's blocks only for requests with the same salt
    # (engine/cache_keys.py), and none of theirs without it
    cache_salt: str | None = None
    # vLLM's: no stop token, end-of-sequence token or stop string ends the answer before its
    # min_tokens-th token (counting the outputs of earlier runs, as output_offset does)
    min_tokens: int = 0
    # structured output (engine/grammar.py): what the answer must be, e.g. JSON of a schema
    guide: Guide | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}", "top_k")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(f"logprobs must be in [0, 20], got {self.logprobs}", "logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise InvalidRequestError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}", "logprobs")
        if not isinstance(self.output_offset, int) or self.output_offset < 0:
            raise InvalidRequestError(f"output_offset must be an integer >= 0, got {self.output_offset!r}", "params")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens + self.output_offset:
            raise InvalidRequestError(
                f"min_tokens must be an integer from 0 to max_tokens ({self.max_tokens}), got {self.min_tokens!r}",
                "min_tokens",
            )
        if self.guide is not None and self.min_tokens:
            raise InvalidRequestError("min_tokens cannot be combined with structured output", "min_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {self.repetition_penalty}",
                "repetition_penalty",
            )
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in self.logit_bias))
        if len(self.logit_bias) > MAX_LOGIT_BIAS or any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise InvalidRequestError(
                f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, each biased by -100 to 100", "logit_bias"
            )
        object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if self.allowed_token_ids and self.guide is not None:
            why = "allowed_token_ids cannot be combined with structured output"
            raise InvalidRequestError(why, "allowed_token_ids")
        object.__setattr__(self, "bad_words", tuple(tuple(w) for w in self.bad_words))
        if len(self.bad_words) > MAX_BAD_WORDS or any(not 0 < len(w) <= MAX_BAD_WORD_TOKENS for w in self.bad_words):
            why = f"bad_words: at most {MAX_BAD_WORDS}, each of 1 to {MAX_BAD_WORD_TOKENS} tokens"
            raise InvalidRequestError(why, "bad_words")
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_SALT_CHARS:
            raise InvalidRequestError(f"cache_salt must be 1 to {MAX_SALT_CHARS} characters", "cache_salt")
        object.__setattr__(self, "decoded", tuple((int(a), int(b)) for a, b in self.decoded))
        ends = [x for span in self.decoded for x in span]
        if any(a >= b for a, b in self.decoded) or ends != sorted(ends) or (ends and ends[0] < 0):
            raise InvalidRequestError(f"decoded: sorted, disjoint spans [start, end), not {self.decoded}", "params")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether its logits change before it samples (engine/penalties.py)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias
            or self.min_tokens or self.allowed_token_ids or self.bad_words
        )  # fmt: skip

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raise InvalidRequestError if a stop token id or a biased token is not in the vocabulary."""
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                raise InvalidRequestError(f"unknown stop token id {t!r} (vocab size {vocab_size})", "stop_token_ids")
        for t, _ in self.logit_bias:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                raise InvalidRequestError(f"logit_bias: unknown token id {t!r} (vocab size {vocab_size})", "logit_bias")
        for t in [*self.allowed_token_ids, *(t for w in self.bad_words for t in w)]:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                raise InvalidRequestError(
                    f"unknown token id {t!r} (vocab size {vocab_size})",
                    "allowed_token_ids" if t in self.allowed_token_ids else "bad_words",
                )

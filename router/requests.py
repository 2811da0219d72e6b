"""OpenAI request bodies (pydantic, strict types) and what they become: token ids and SamplingParams."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, ClassVar, cast

from pydantic import Field, PrivateAttr, model_validator

from engine.errors import InvalidRequestError, PromptTooLongError
from engine.grammar import Guide
from engine.sampling_params import MAX_REPETITION_PENALTY, SamplingParams
from router.answer_marks import answer_spans
from router.backend import ModelInfo
from router.bodies import StrictBody
from router.chat_messages import Message, render, template_messages
from router.errors import APIError
from router.prompt_tokens import PromptTokens, check_fits, completion_tokens, encode
from router.response_format import guide_of
from router.tools import Tool, ToolChoice, ToolPlan, tool_plan
from router.vllm_fields import VLLMChatFields, VLLMFields, bad_word_ids

log = logging.getLogger("tandem.router")

_I64 = 2**63
# Stop strings are matched against every new piece of output and held back while a prefix of one
# is pending: their number and length bound that work and the streaming delay.
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_N = 16  # choices one request may ask for (router/choices.py): each runs as a request of its own
MAX_CHOICES = 64  # ... and over all its prompts (a completion's list), n of each


class StreamOptions(StrictBody):
    include_usage: bool = False


class _Common(VLLMFields):
    # max_tokens when a request leaves it out and the router sets no default: None = the rest of
    # the context (OpenAI's and vLLM's chat; a 256-token cap here cut 5 of 12 SmolLM2 answers at
    # temperature 1.0 short, with finish_reason "length")
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, body: Any) -> Any:
        """A field sent as null takes its default, as OpenAI's API and vLLM read it (clients send
        `"temperature": null` for "not set"); a required one is then missing."""
        return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body

    model: str | None = None  # vLLM's and SGLang's reading: none sent is the served model
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # -1 and 0: off
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # extension (vLLM's): 0 off
    seed: int | None = Field(default=None, ge=-_I64, lt=2 * _I64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    n: int = 1
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=MAX_REPETITION_PENALTY)  # extension (vLLM's)
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias in [-100, 100]
    min_tokens: int = Field(default=0, ge=0)  # extension (vLLM's): nothing stops the answer before it
    ignore_eos: bool = False
    priority: int = 0  # extension: lower runs first (vLLM's convention); clamped to the router's range
    speculate: bool = True  # extension: false opts this request out of speculative decoding
    # text, json_object or json_schema (engine/grammar.py); a completion's too, as vLLM takes it
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None  # extensions (vLLM's): one guide at most
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM's): these end the answer too
    skip_special_tokens: bool = True  # extension (vLLM's): special tokens out of the text

    @property
    def prompt_scores(self) -> int | None:
        """The top N of the prompt's logprobs for the engine to compute (a completion's echo asks too)."""
        return None if self.stream else self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _default_max(self, router_default: int | None, room: int) -> int:
        """max_tokens for a request that names none: `room` is what its prompt leaves of the context."""
        default = router_default if router_default is not None else self.DEFAULT_MAX_TOKENS
        return room if default is None else min(default, room)

    def check_supported(self) -> None:
        """Refuse, with a message, what this server does not do (rather than ignore it)."""
        self.check_vllm_fields(self.stream)
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be from 1 to {MAX_N} (got {self.n})", param="n")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOPS:
            raise APIError(400, f"at most {MAX_STOPS} stop sequences (got {len(stops)})", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise APIError(400, f"a stop sequence may be at most {MAX_STOP_CHARS} characters long", param="stop")

    def sampling(
        self,
        prompt: PromptTokens,
        model: ModelInfo,
        default_max: int | None,
        max_tokens: int | None,
        logprobs: int | None,
    ) -> SamplingParams:
        """SamplingParams for `prompt`; with no `max_tokens`, `default_max` (the router's) or
        DEFAULT_MAX_TOKENS, within the context. Raises PromptTooLongError (413),
        InvalidRequestError (400) for what does not fit the context or the engine refuses."""
        prompt_len = len(prompt.ids)
        limit = model.max_model_len
        if prompt_len >= limit:
            raise PromptTooLongError(
                f"the prompt has {prompt_len} tokens; this model's context is {limit} tokens",
                "messages" if isinstance(self, ChatCompletionRequest) else "prompt",
            )
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context of {limit} tokens",
                "max_tokens",
            )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        params = SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else self._default_max(default_max, limit - prompt_len),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            seed=self.seed,
            stop=tuple(stop),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            priority=self.priority,
            speculate=self.speculate,
            decoded=prompt.decoded,
            decoded_as_prompt=prompt.decoded_as_prompt,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self._bias(model.tokenizer.vocab_size),
            min_tokens=self.min_tokens,
            prompt_logprobs=self.prompt_scores,
            guide=self._guide(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            allowed_token_ids=tuple(self.allowed_token_ids or ()),
            bad_words=bad_word_ids(model.tokenizer, self.bad_words),
            cache_salt=self.cache_salt,
        )
        params.validate_for_vocab(model.tokenizer.vocab_size)  # stop token ids here, not on a worker
        return params

    def _guide(self) -> Guide | None:
        """What the answer's grammar holds it to (router/response_format.py), if anything."""
        vllm = self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar
        return guide_of(self.response_format, *vllm)

    def _bias(self, vocab: int) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs; APIError (400) for a key that is not a token id
        of this model (SamplingParams checks the biases and their number)."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            token = int(key) if key.strip().isdigit() else -1
            if not 0 <= token < vocab:
                raise APIError(400, f"logit_bias: {key!r} is not a token id of this model (0 to {vocab - 1})",
                               param="logit_bias")  # fmt: skip
            pairs.append((token, bias))
        return tuple(pairs)


class ChatCompletionRequest(_Common, VLLMChatFields):
    messages: list[Message]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None  # router/tools.py
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # only an explicit true asks for a list of calls (router/tools.py)
    add_generation_prompt: bool = True  # extensions (vLLM's): false renders the messages alone
    continue_final_message: bool = False  # the answer goes on from the final (assistant's) message's text
    _tool_plan: ToolPlan | None = PrivateAttr(default=None)

    def check_supported(self) -> None:
        super().check_supported()
        self.refuse_unserved_chat()
        if not self.messages:
            raise APIError(400, "messages must be a non-empty list", param="messages")
        plan = tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls is True)
        if plan is not None and super()._guide() is not None:
            raise APIError(400, "tools (unless tool_choice is none) hold the answer to their own JSON: "
                           "leave out response_format and guided_*", param="tool_choice")  # fmt: skip
        self._tool_plan = plan
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError(400, "continue_final_message needs an assistant's message last", param="messages")
        if self.continue_final_message and plan is not None:
            raise APIError(400, "continue_final_message with tools: a call starts an answer, it does not go on "
                           "from one", param="continue_final_message")  # fmt: skip

    def _guide(self) -> Guide | None:
        return self._tool_plan.guide if self._tool_plan is not None else super()._guide()

    @property
    def tool_plan(self) -> ToolPlan | None:
        """What its tools ask of the answer (set by check_supported); None for plain text."""
        return self._tool_plan

    def prompt_tokens(self, model: ModelInfo, exact_history: bool = True) -> PromptTokens:
        """The messages through the model's chat template, then the tokenizer, with the spans of
        the earlier answers (SamplingParams.decoded), to be prefilled all the same unless
        `exact_history`. Raises InvalidRequestError (400) for whatever the template or the
        tokenizer refuses, PromptTooLongError (413) for a text that cannot fit the context."""
        messages = template_messages(self.messages, self._tool_plan, self.parallel_tool_calls is True)
        go_on, variables = self.continue_final_message, self.template_variables
        text = render(model.tokenizer, messages, self.add_generation_prompt, go_on, variables)
        if self.truncate_prompt_tokens is None:
            check_fits(model, text, "messages")
        spans = answer_spans(model.tokenizer, messages, text, variables)
        if self.continue_final_message:  # the client's text to go on from, not an answer to replay exactly
            spans = [(a, b) for a, b in spans if b < len(text)]
        room = model.max_model_len - (self.max_new or 1)
        prompt = encode(model, text, "messages", spans).last(self.truncate_prompt_tokens, room)
        return prompt if exact_history or not prompt.decoded else replace(prompt, decoded_as_prompt=True)

    @property
    def prompt_chars(self) -> int:
        """Characters to template and tokenize."""
        return sum(len(m.text) + sum(len(c.function.arguments) for c in m.tool_calls or ()) for m in self.messages)

    @property
    def logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions, vLLM's and SGLang's

    prompt: str | list[int] | list[str] | list[list[int]]  # a list of strings or of id lists: prompts
    max_tokens: int | None = Field(default=None, ge=0)  # 0: with echo, the prompt alone (router/echo.py)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 asks for the prompt alone, with echo)",
                           param="max_tokens")  # fmt: skip
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of must be 1", param="best_of")

    @property
    def prompt_chars(self) -> int:
        """Characters to tokenize (none for token ids)."""
        p = self.prompt
        return len(p) if isinstance(p, str) else sum(len(x) for x in p if isinstance(x, str))

    @property
    def prompt_scores(self) -> int | None:
        return max((n for n in (super().prompt_scores, self.logprobs if self.echo else None) if n is not None),
                   default=None)  # fmt: skip

    @property
    def prompts(self) -> list[str | list[int]]:
        """Its prompts, each a string or token ids; APIError (400) for more than fit MAX_CHOICES."""
        p = self.prompt
        several = list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if len(several) * self.n > MAX_CHOICES:
            why = f"{len(several)} prompts, n = {self.n}"
            raise APIError(400, f"at most {MAX_CHOICES} choices (prompts x n) a request, not {why}", param="prompt")
        return cast(list[str | list[int]], several)

    def prompt_tokens(self, model: ModelInfo) -> list[PromptTokens]:
        answer = self.max_tokens or 1  # (none named: the default, within what the prompt leaves)
        return [completion_tokens(model, p, self.truncate_prompt_tokens, answer) for p in self.prompts]

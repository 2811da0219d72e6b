"""OpenAI response bodies: whole answers, stream chunks and logprobs, for chat and plain completions."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cluster.outputs import StreamOutput
from engine.outputs import TokenLogprob
from engine.tokenizer import Tokenizer
from router.tool_stream import ToolStream
from router.tools import ToolCall, ToolPlan

# What OpenAI reports for a token of no probability: JSON has no -inf (nor NaN).
NO_PROBABILITY = -9999.0


def _logprob(value: Any) -> float:
    x = float(value)
    return x if math.isfinite(x) and x > NO_PROBABILITY else NO_PROBABILITY


@dataclass
class Shape:
    """What every body of one response shares."""

    kind: str  # "chat" | "completion"
    id: str
    model: str
    tokenizer: Tokenizer
    created: int = field(default_factory=lambda: int(time.time()))
    tools: ToolPlan | None = None  # a chat whose answers are tool calls (router/tools.py)
    held: dict[int, list[str]] = field(default_factory=dict)  # ... streamed: each choice's text so far
    reading: dict[int, ToolStream] = field(default_factory=dict)  # ... and its answer read as it comes
    prompt_top: int | None = None  # vLLM's `prompt_logprobs` asked (a whole answer): its top N
    as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def _token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.tokenizer.token_text(token_id)

    def logprobs(self, entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any] | None:
        """The `logprobs` object of a choice; None when none were asked for."""
        if not entries:
            return None
        if self.kind == "chat":
            return {"content": [self._chat_logprob(e) for e in entries]}
        tokens = [self._token(int(e.token_id)) for e in entries]
        offsets = []
        for e in entries:  # in the text, whatever names the tokens
            offsets.append(offset)
            offset += len(self.tokenizer.token_text(int(e.token_id)))
        # a NaN logprob: an echoed prompt's first token (router/echo.py), null here
        values = [None if math.isnan(e.logprob) else _logprob(e.logprob) for e in entries]
        tops = [{self._token(int(i)): _logprob(lp) for i, lp in e.top} for e in entries]
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": [None if v is None else top for v, top in zip(values, tops, strict=True)],
            "text_offset": offsets,
        }

    def prompt_logprobs(self, entries: Sequence[TokenLogprob]) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs` of a prompt, from its tokens' entries (the engine's, 1 to n - 1):
        null for its first token (nothing predicts it), then for each token {id: {logprob, rank,
        decoded_token}}, the token's own first and then the top N not already there."""

        def one(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
            return {"logprob": _logprob(logprob), "rank": rank, "decoded_token": self._token(token_id)}

        shaped: list[dict[str, Any] | None] = [None]
        for e in entries:
            scores = {str(e.token_id): one(int(e.token_id), e.logprob, e.rank)}
            for place, (token_id, logprob) in enumerate(e.top[: self.prompt_top or 0], start=1):
                scores.setdefault(str(token_id), one(int(token_id), logprob, place))
            shaped.append(scores)
        return shaped

    def _chat_logprob(self, e: TokenLogprob) -> dict[str, Any]:
        def one(token_id: int, logprob: float) -> dict[str, Any]:
            text = self._token(token_id)
            return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode("utf-8"))}

        return {**one(int(e.token_id), e.logprob), "top_logprobs": [one(int(i), lp) for i, lp in e.top]}

    def _choice(
        self, text: str | None, finish: str | None, logprobs: dict[str, Any] | None, delta: bool, index: int = 0
    ) -> Any:
        if self.kind == "completion":
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        if delta:
            body: dict[str, Any] = {} if text is None else {"content": text}
            return {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tools is not None:
            answer = self.tools.answer(text or "", finish)
            message["content"], finish = answer.content, answer.finish(finish)
            if answer.calls:
                message["tool_calls"] = [c.body() for c in answer.calls]
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def whole(
        self,
        text: str,
        finish: str | None,
        usage: dict[str, int],
        logprobs: dict[str, Any] | None,
        prompt: Sequence[TokenLogprob] = (),
    ) -> dict[str, Any]:
        return self.whole_choices([(text, finish, logprobs)], usage, [prompt])

    def whole_choices(
        self,
        choices: Sequence[tuple[str, str | None, dict[str, Any] | None]],
        usage: dict[str, int],
        prompts: Sequence[Sequence[TokenLogprob]] = (),
    ) -> dict[str, Any]:
        """A whole response with a choice for each (text, finish reason, logprobs), in order; where
        `prompt_top` asks, each choice's prompt logprobs from `prompts` (a chat's: the response's,
        as vLLM puts them)."""
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(t, f, lp, delta=False, index=i) for i, (t, f, lp) in enumerate(choices)],
            "usage": usage,
        }
        if self.prompt_top is not None and self.kind == "chat":
            body["prompt_logprobs"] = self.prompt_logprobs(prompts[0])
        elif self.prompt_top is not None:
            for choice, entries in zip(body["choices"], prompts, strict=True):
                choice["prompt_logprobs"] = self.prompt_logprobs(entries)
        return body

    def chunk(
        self,
        text: str | None,
        finish: str | None = None,
        logprobs: dict[str, Any] | None = None,
        *,
        role: bool = False,
        include_usage: bool = False,
        index: int = 0,
    ) -> dict[str, Any]:
        choice = self._choice(text, finish, logprobs, delta=True, index=index)
        if role:
            choice["delta"] = {"role": "assistant", **choice["delta"]}
        body = {
            "id": self.id,
            "object": self.object + ("" if self.kind == "completion" else ".chunk"),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self.chunk(None), "choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: the prompt tokens whose KV a
    worker's prefix cache held (what OpenAI bills at the cached rate)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


# Logprob entries past which a response's body is shaped and encoded on a thread: an 8K-token echo
# with 20 alternatives a position took 0.15-0.3 s of Python, a pause for every stream on the
# router's event loop (on a thread it yields the GIL to the loop every few milliseconds).
OFF_LOOP_ENTRIES = 1024
T = TypeVar("T")


async def off_loop_if_large(entries: int, build: Callable[[], T]) -> T:
    """build(); on a thread where it shapes more than OFF_LOOP_ENTRIES logprob entries."""
    return build() if entries <= OFF_LOOP_ENTRIES else await asyncio.to_thread(build)


def sse(body: dict[str, Any] | str) -> bytes:
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def encoded_chunks(
    shape: Shape, out: StreamOutput, offset: int, include_usage: bool, index: int, last: dict[str, Any] | None
) -> tuple[list[bytes], int]:
    """`output_chunks` as SSE frames, the last with `tandem: last` where given."""
    bodies, offset = output_chunks(shape, out, offset, include_usage, index)
    if last is not None:
        bodies[-1]["tandem"] = last
    return [sse(body) for body in bodies], offset


def output_chunks(
    shape: Shape, out: StreamOutput, offset: int, include_usage: bool, index: int = 0
) -> tuple[list[dict[str, Any]], int]:
    """The stream chunks for one output of choice `index` (none, one, or two: a chat's text, then
    its finish reason), and the choice's text offset after it."""
    chat = shape.kind == "chat"
    if chat and shape.tools is not None:
        return _tool_chunks(shape, shape.tools, out, offset, include_usage, index), offset + len(out.text)
    text = out.text
    lp = shape.logprobs(out.logprobs, offset)
    finish = out.finish_reason if out.finished else None
    bodies = []
    if chat and (text or lp):
        bodies.append(shape.chunk(text, None, lp, include_usage=include_usage, index=index))
    if finish or (not chat and (text or lp)):
        bodies.append(shape.chunk(None if chat else text, finish, None if chat else lp,
                                  include_usage=include_usage, index=index))  # fmt: skip
    return bodies, offset + len(text)


def _tool_chunks(
    shape: Shape, plan: ToolPlan, out: StreamOutput, offset: int, include_usage: bool, index: int
) -> list[dict[str, Any]]:
    """A tool-calling choice's chunks for one output, its answer read as it comes
    (router/tool_stream.py): the response's text as content, each call's id and name once whole
    and then its arguments as they grow, logprobs as they come. An answer that does not read as
    that JSON (cut short before anything could be sent, say) is sent at its end as router/tools.py
    reads it whole. Then the finish reason: "tool_calls" where calls were made."""
    held = shape.held.setdefault(index, [])
    held.append(out.text)
    reading = shape.reading.setdefault(index, ToolStream())
    delta = reading.feed(out.text)
    lp = shape.logprobs(out.logprobs, offset)
    bodies = []
    if delta.content or lp:
        bodies.append(shape.chunk(delta.content or None, None, lp, include_usage=include_usage, index=index))
    if delta.calls:
        calls = shape.chunk(None, include_usage=include_usage, index=index)
        calls["choices"][0]["delta"] = {"tool_calls": [_call_delta(i, c, args) for i, c, args in delta.calls]}
        bodies.append(calls)
    if not (out.finished and out.finish_reason):
        return bodies
    finish: str | None = out.finish_reason
    if reading.settled or reading.calls or reading.content:
        finish = "tool_calls" if reading.calls and reading.settled else finish
    else:  # nothing sent: the whole answer, as a whole response reads it
        answer = plan.answer("".join(held), out.finish_reason)
        last = shape.chunk(answer.content, include_usage=include_usage, index=index)
        if answer.calls:
            last["choices"][0]["delta"] = {"tool_calls": [c.body(i) for i, c in enumerate(answer.calls)]}
        bodies.append(last)
        finish = answer.finish(out.finish_reason)
    return [*bodies, shape.chunk(None, finish, include_usage=include_usage, index=index)]


def _call_delta(index: int, begun: ToolCall | None, arguments: str) -> dict[str, Any]:
    """One call's part of a delta, as OpenAI streams it: where it begins, its id, type and name."""
    if begun is not None:
        return {**begun.body(index), "function": {"name": begun.name, "arguments": arguments}}
    return {"index": index, "function": {"arguments": arguments}}

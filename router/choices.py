"""OpenAI's `n`, and a completion's list of prompts: n choices of each prompt, each its own
engine request, answered as one response (choice `i * n + j`: prompt i's j-th).

Choice 0 starts first; each prompt's first choice then, and its others once that one's first
token is out, so that its prompt is in the prefix cache they are routed by (a prompt of any
length is prefilled about once). Each choice holds an admission slot and has its own Trace
(request id `<id>-<i>` past the first), so the log and the metrics count a request a choice.
With a `seed`, choice j of a prompt samples from seed + j: its choice 0 is the n = 1 answer, and
each choice is the answer of an n = 1 request with its seed. `usage` counts each prompt once and
every choice's tokens; `x-tandem-timing` is choice 0's.

A choice that fails fails the response: whole, with its error; streamed, with an error event
once streaming started. The client leaving, or any end, closes every choice's run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse

from cluster.outputs import StreamOutput
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams
from router.dispatch import Dispatcher, Run
from router.echo import Echo
from router.errors import as_api_error
from router.responses import Shape, off_loop_if_large, sse, usage
from router.trace import Trace

_SEEDS = 2**64


def seeded(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i's sampling: seed + i (within the seeds a request may send), if seeded."""
    if i == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed + i + _SEEDS // 2) % _SEEDS - _SEEDS // 2)


def scored(params: SamplingParams, prompt: Prompt, j: int) -> SamplingParams:
    """Choice j's prompt logprobs: its prompt's first choice computes them for all (they are the
    same, and a request that asks for them reads no prefix cache), unless it echoes them."""
    if j == 0 or params.prompt_logprobs is None or (prompt.echo is not None and prompt.echo.logprobs is not None):
        return params
    return replace(params, prompt_logprobs=None)


def choice_trace(trace: Trace, i: int, prompt_tokens: int) -> Trace:
    """Choice i's Trace: choice 0's is the request's own."""
    if i == 0:
        return trace
    t = Trace(f"{trace.request_id}-{i}", trace.endpoint, trace.stream, trace.priority, trace.user, client=trace.client)
    t.prompt_tokens, t.t_arrival = prompt_tokens, trace.t_arrival
    return t


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request, as its choices run it."""

    ids: Sequence[int]
    params: SamplingParams
    echo: Echo | None = None  # a completion's `echo` (router/echo.py)


@dataclass
class Choice:
    """One choice under way: its trace, its run once started, and what it has said."""

    index: int
    trace: Trace
    params: SamplingParams
    prompt: Prompt
    first: bool  # its prompt's first choice: the others of that prompt start once it has a token
    run: Run | None = None
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # where asked: its prompt's, with its first output

    def tandem(self) -> dict[str, Any]:
        """The `tandem` field of its last chunk: its request id and timing breakdown."""
        return {"request_id": self.trace.request_id, "timing": self.trace.timing()}


class Choices:
    """The n choices of each prompt of one request, run side by side; `outputs()` merges their
    streams."""

    def __init__(self, d: Dispatcher, prompts: Sequence[Prompt], trace: Trace, n: int) -> None:
        self._d = d
        self._prompts = prompts
        self.retry_after_s = d.settings.retry_after_s
        self.choices = [
            Choice(i * n + j, choice_trace(trace, i * n + j, len(p.ids)), scored(seeded(p.params, j), p, j), p, j == 0)
            for i, p in enumerate(prompts)
            for j in range(n)
        ]
        # a prompt's first choice has its first token: the others of that prompt may start
        self._prefilled = [asyncio.Event() for _ in prompts]
        # bounded: a client that reads slowly holds the pumps back, as it holds one run's back
        self._queue: asyncio.Queue[tuple[int, StreamOutput | BaseException | None]] = asyncio.Queue(
            16 * len(self.choices)
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self.n = n

    async def start(self) -> None:
        """Start choice 0 (to its first token), then the rest, which stream as they come. Raises
        what choice 0's start raised."""
        first = self.choices[0]
        first.run = await self._d.start(first.prompt.ids, first.params, first.trace, first.prompt.echo)
        self._prefilled[0].set()
        self._tasks = [asyncio.ensure_future(self._pump(c)) for c in self.choices]

    async def _pump(self, c: Choice) -> None:
        prefilled = self._prefilled[c.index // self.n]
        try:
            if c.run is None:
                if not c.first:
                    await prefilled.wait()
                c.run = await self._d.start(c.prompt.ids, c.params, c.trace, c.prompt.echo)
                if self._closed:  # started as the response ended (a start may outlive its cancel)
                    c.run.close()
                    return
            prefilled.set()
            async for out in c.run.outputs():
                await self._queue.put((c.index, out))
            await self._queue.put((c.index, None))
        except Exception as e:
            prefilled.set()  # the response fails with `e`: the others need not wait
            await self._queue.put((c.index, e))

    async def outputs(self) -> AsyncIterator[tuple[int, StreamOutput]]:
        """(choice, output) until every choice has finished. Raises what a choice raised."""
        live = len(self.choices)
        while live:
            i, item = await self._queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item

    def usage(self) -> dict[str, Any]:
        """Each prompt once (and its first choice's cached count), every choice's tokens."""
        firsts = [c.trace for c in self.choices if c.first]
        cached = sum(t.placement.cached_tokens for t in firsts if t.placement is not None)
        prompts = sum(len(p.ids) for p in self._prompts)
        return usage(prompts, sum(c.trace.completion_tokens for c in self.choices), cached)

    def close(self, error: Exception | None = None, gone_status: int = 499) -> None:
        """End every choice (idempotent): its run closed, its trace finished, with `error`'s
        status where given, as the client leaving where it had not finished."""
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        err = as_api_error(error, self.retry_after_s) if error is not None else None
        for c in self.choices:
            if c.run is not None:
                c.run.close()
            if err is not None and c.trace.status == 200:
                c.trace.status, c.trace.error = err.status, err.message
            elif c.trace.status == 200 and c.trace.finish_reason is None:
                c.trace.status = gone_status
            self._d.finish(c.trace)

    async def wait_closed(self) -> None:
        """Wait for the pumps close() cancelled (each closes what it started)."""
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        for c in self.choices:  # a start that returned as it was cancelled
            if c.run is not None:
                c.run.close()


async def whole(
    choices: Choices, shape: Shape, until: Callable[[Awaitable[None]], Awaitable[bool]], gone: int
) -> Response:
    """Run every choice to its end (`until`: False if the client left first) and answer whole."""
    finishes: dict[int, str | None] = {}

    async def collect() -> None:
        await choices.start()
        async for i, out in choices.outputs():
            c = choices.choices[i]
            c.text += out.text
            c.logprobs.extend(out.logprobs)
            c.prompt_logprobs = c.prompt_logprobs or out.prompt_logprobs
            if out.finished:
                finishes[i] = out.finish_reason

    try:
        done = await until(collect())
    except Exception as e:
        choices.close(e)
        await choices.wait_closed()
        return as_api_error(e, choices.retry_after_s).response()
    choices.close(gone_status=gone)
    await choices.wait_closed()
    if not done:
        return Response(status_code=gone)
    counts, timing = choices.usage(), json.dumps(choices.choices[0].trace.timing(), separators=(",", ":"))

    # a prompt's prompt logprobs, from its first choice
    prompts = [choices.choices[c.index - c.index % choices.n].prompt_logprobs for c in choices.choices]

    def respond() -> JSONResponse:
        each = [(c.text, finishes.get(c.index), shape.logprobs(c.logprobs)) for c in choices.choices]
        return JSONResponse(shape.whole_choices(each, counts, prompts), headers={"x-tandem-timing": timing})

    entries = sum(len(c.logprobs) for c in choices.choices) + sum(len(p) for p in prompts)
    return await off_loop_if_large(entries, respond)


async def events(
    choices: Choices,
    shape: Shape,
    include_usage: bool,
    chunks: Callable[[Shape, StreamOutput, int, bool, int, dict[str, Any] | None], tuple[list[bytes], int]],
) -> AsyncIterator[bytes]:
    """The SSE stream of started `choices`: each choice's role chunk, then their chunks as they
    come, each with its index; the usage once all have finished."""
    offsets = [0] * len(choices.choices)
    try:
        if shape.kind == "chat":
            for c in choices.choices:
                yield sse(shape.chunk("", role=True, include_usage=include_usage, index=c.index))
        async for i, out in choices.outputs():
            # the last chunk of a choice carries its timing, as an n = 1 stream's does
            last = choices.choices[i].tandem() if out.finished and out.finish_reason and not include_usage else None
            encode = partial(chunks, shape, out, offsets[i], include_usage, i, last)
            frames, offsets[i] = await off_loop_if_large(len(out.logprobs), encode)
            for frame in frames:
                yield frame
        if include_usage:
            yield sse({**shape.usage_chunk(choices.usage()), "tandem": choices.choices[0].tandem()})
        yield sse("[DONE]")
        choices.close()
    except Exception as e:
        choices.close(e)
        yield sse(as_api_error(e, choices.retry_after_s).body())
        yield sse("[DONE]")
    finally:
        choices.close()
        await choices.wait_closed()

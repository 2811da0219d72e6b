"""The /v1 endpoints: models, chat completions and completions, whole or streamed as SSE."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.outputs import TokenLogprob
from engine.spans import TraceContext
from engine.tokenizer import Tokenizer
from router import choices
from router.auth import api_key_check
from router.choices import Choices, Prompt
from router.dispatch import Dispatcher, Run
from router.echo import Echo
from router.errors import APIError, as_api_error
from router.prompt_tokens import PromptTokens
from router.requests import ChatCompletionRequest, CompletionRequest
from router.responses import Shape, encoded_chunks, off_loop_if_large, sse, usage
from router.trace import Trace

CLIENT_GONE = 499  # nginx's "client closed request", for the log line and metrics
INLINE_TOKENIZE_CHARS = 2048  # longer prompts tokenize on a thread, off the event loop


class EventStream(StreamingResponse):
    """SSE that always ends its request, on a client disconnect included, so that the request is
    aborted on the workers and its KV freed at once: the body generator is closed, then `on_close`
    runs (which must be idempotent: it also covers a body that never started). The disconnect is
    watched by one plain task, not Starlette's per-response anyio task group (~0.2 ms a request)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content)
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _unless_disconnected(receive, self.stream_response(send))
        finally:
            try:
                aclose = getattr(self._content, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self._on_close()


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def build(d: Dispatcher) -> APIRouter:
    api = APIRouter(prefix="/v1", dependencies=[Depends(api_key_check(d.settings))])
    model = d.backend.model
    name = d.settings.model_name or model.name

    card = {"id": name, "object": "model", "created": model.created, "owned_by": "tandem",
            "max_model_len": model.max_model_len}  # fmt: skip

    @api.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @api.get("/models/{model_id:path}")  # the SDK's models.retrieve (an id may hold a "/")
    async def one_model(model_id: str) -> dict[str, Any]:
        if model_id != name:
            raise APIError(404, f"The model `{model_id}` does not exist", param="model", code="model_not_found")
        return card

    @api.post("/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        body = body.model_copy(update={"priority": d.settings.clamp_priority(body.priority)})
        return await _serve(
            d,
            request,
            body,
            "chat",
            lambda: [body.prompt_tokens(model, d.settings.exact_history)],
            body.max_new,
            body.logprobs_n,
        )

    @api.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        body = body.model_copy(update={"priority": d.settings.clamp_priority(body.priority)})
        max_tokens = 1 if body.max_tokens == 0 else body.max_tokens  # 0: the prompt alone (router/echo.py)
        return await _serve(d, request, body, "completion", lambda: body.prompt_tokens(model), max_tokens,
                            body.logprobs)  # fmt: skip

    return api


async def _serve(
    d: Dispatcher,
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    kind: str,
    prompt: Callable[[], list[PromptTokens]],  # a completion may send several (router/choices.py)
    max_tokens: int | None,
    logprobs: int | None,
) -> Response:
    rid: str = request.state.request_id
    client = TraceContext.parse(request.headers.get("traceparent"))
    trace = Trace(rid, kind, stream=body.stream, priority=body.priority, user=body.user, client=client)
    model = d.backend.model
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    shape = Shape(kind, prefix + rid, d.settings.model_name or model.name, model.tokenizer)
    try:
        if body.model is not None and body.model != (d.settings.model_name or model.name):
            raise APIError(404, f"The model `{body.model}` does not exist", param="model", code="model_not_found")
        body.check_supported()
        shape.tools = body.tool_plan if isinstance(body, ChatCompletionRequest) else None
        shape.prompt_top, shape.as_ids = None if body.stream else body.prompt_logprobs, body.return_tokens_as_token_ids
        # a short prompt tokenizes in tens of microseconds: less than a hop to a thread and back
        inline = body.prompt_chars <= INLINE_TOKENIZE_CHARS
        prompts = [
            Prompt(t.ids, body.sampling(t, model, d.settings.default_max_tokens, max_tokens, logprobs),
                   _echo(body, i, t.ids, model.tokenizer))
            for i, t in enumerate(prompt() if inline else await asyncio.to_thread(prompt))
        ]  # fmt: skip
        trace.prompt_tokens = len(prompts[0].ids)
        if body.n > 1 or len(prompts) > 1:
            return await _serve_choices(d, request, body, Choices(d, prompts, trace, body.n), shape)
        start = d.start(prompts[0].ids, prompts[0].params, trace, prompts[0].echo)
    except Exception as e:
        return _failed(d, trace, e)
    if not body.stream:
        return await _whole(d, start, shape, trace, request)
    try:
        run = await _unless_gone(request.receive, start)
    except Exception as e:
        return _failed(d, trace, e)
    if run is None:  # gone while queued, in prefill or in transfer: all of it is cancelled
        trace.status = CLIENT_GONE
        d.finish(trace)
        return Response(status_code=CLIENT_GONE)
    return EventStream(_events(d, run, shape, trace, body.include_usage), lambda: _end(d, run, trace))


async def _serve_choices(
    d: Dispatcher, request: Request, body: ChatCompletionRequest | CompletionRequest, many: Choices, shape: Shape
) -> Response:
    """A request with n > 1 (router/choices.py)."""
    if not body.stream:
        return await choices.whole(many, shape, lambda work: _unless_disconnected(request.receive, work), CLIENT_GONE)
    try:
        started = await _unless_disconnected(request.receive, many.start())
    except Exception as e:
        many.close(e)
        await many.wait_closed()
        return as_api_error(e, d.settings.retry_after_s).response()
    if not started:
        many.close(gone_status=CLIENT_GONE)
        await many.wait_closed()
        return Response(status_code=CLIENT_GONE)
    return EventStream(choices.events(many, shape, body.include_usage, encoded_chunks), many.close)


def _echo(
    body: ChatCompletionRequest | CompletionRequest, i: int, ids: Sequence[int], tokenizer: Tokenizer
) -> Echo | None:
    """What a completion with `echo` puts in front of prompt i's answers: its text as sent, or as served."""
    if not isinstance(body, CompletionRequest) or not body.echo:
        return None
    prompt = body.prompts[i]
    if not isinstance(prompt, str) or body.truncate_prompt_tokens is not None:  # the ids served
        prompt = tokenizer.decode(list(ids), skip_special_tokens=False)
    return Echo.of(prompt, ids, body.logprobs, body.max_tokens)


def _failed(d: Dispatcher, trace: Trace, e: Exception) -> JSONResponse:
    err = as_api_error(e, d.settings.retry_after_s)
    trace.status, trace.error = err.status, err.message
    d.finish(trace)
    return err.response()


async def _whole(d: Dispatcher, start: Awaitable[Run], shape: Shape, trace: Trace, request: Request) -> Response:
    """Start the request and collect all of it, both under one watch for the client leaving."""
    texts: list[str] = []
    entries: list[Any] = []
    prompt: list[TokenLogprob] = []  # its prompt logprobs (with the first output)
    runs: list[Run] = []

    async def collect() -> None:
        runs.append(run := await start)
        async for out in run.outputs():
            texts.append(out.text)
            entries.extend(out.logprobs)
            prompt[:] = prompt or out.prompt_logprobs

    try:
        done = await _unless_disconnected(request.receive, collect())
    except Exception as e:
        return _failed(d, trace, e)
    finally:
        for run in runs:
            run.close()
    if not done:
        trace.status = CLIENT_GONE
        d.finish(trace)
        return Response(status_code=CLIENT_GONE)
    d.finish(trace)
    counts, timing = usage_of(trace), json.dumps(trace.timing(), separators=(",", ":"))

    def respond() -> JSONResponse:
        body = shape.whole("".join(texts), trace.finish_reason, counts, shape.logprobs(entries), prompt)
        return JSONResponse(body, headers={"x-tandem-timing": timing})

    return await off_loop_if_large(len(entries) + len(prompt), respond)


async def _unless_gone(receive: Receive, start: Awaitable[Run]) -> Run | None:
    """The admitted request with its first output, or None (and `start` cancelled, which
    gives back its admission slot and cancels its prefill and transfer) if the client goes first."""
    task = asyncio.ensure_future(start)
    watcher = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        run = await task
        run.close()  # it got its first token just as the client left
    return None


async def _unless_disconnected(receive: Receive, work: Awaitable[None]) -> bool:
    """Run `work`; False (and `work` cancelled) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t
    if not task.done() or task.cancelled():
        return False
    task.result()
    return True


async def _events(d: Dispatcher, run: Run, shape: Shape, trace: Trace, include_usage: bool) -> AsyncIterator[bytes]:
    def tandem() -> dict[str, Any]:
        return {"request_id": trace.request_id, "timing": trace.timing()}

    offset = 0
    try:
        if shape.kind == "chat":
            yield sse(shape.chunk("", role=True, include_usage=include_usage))
        async for out in run.outputs():
            # the timing breakdown rides on the last chunk
            last = tandem() if out.finished and out.finish_reason and not include_usage else None
            encode = partial(encoded_chunks, shape, out, offset, include_usage, 0, last)
            frames, offset = await off_loop_if_large(len(out.logprobs), encode)
            for frame in frames:
                yield frame
        if include_usage:
            yield sse({**shape.usage_chunk(usage_of(trace)), "tandem": tandem()})
        yield sse("[DONE]")
    except Exception as e:
        err = as_api_error(e, d.settings.retry_after_s)
        trace.status, trace.error = err.status, err.message
        yield sse(err.body())
        yield sse("[DONE]")
    finally:
        _end(d, run, trace)


def usage_of(trace: Trace) -> dict[str, Any]:
    """The request's usage; its cached count is the first attempt's (the breakdown's too)."""
    cached = trace.placement.cached_tokens if trace.placement is not None else 0
    return usage(trace.prompt_tokens, trace.completion_tokens, cached)


def _end(d: Dispatcher, run: Run, trace: Trace) -> None:
    run.close()
    if trace.status == 200 and trace.finish_reason is None:
        trace.status = CLIENT_GONE
    d.finish(trace)

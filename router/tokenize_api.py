"""`POST /tokenize` and `POST /detokenize` (vLLM's): the model's token ids for a prompt or a chat
(through its template, as /v1/chat/completions serves it), and the text of token ids. Clients
count tokens with them before they send, and scorers line up prompt logprobs against them."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import Field

from router.auth import api_key_check
from router.backend import ModelInfo
from router.bodies import StrictBody
from router.chat_messages import Message
from router.errors import APIError, as_api_error
from router.requests import ChatCompletionRequest, CompletionRequest
from router.settings import RouterSettings
from router.tools import Tool, ToolChoice

CHAT_FIELDS = {
    "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs", "documents",
}  # fmt: skip
INLINE_CHARS = 2048  # longer texts (or id lists) are tokenized (decoded) on a thread, off the event loop


class TokenizeBody(StrictBody):
    model: str | None = None  # none: the served model
    prompt: str | list[int] | None = None
    messages: list[Message] | None = None
    tools: list[Tool] | None = None  # a chat's tools are described in its prompt (router/tools.py)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None


class DetokenizeBody(StrictBody):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def build(model: ModelInfo, settings: RouterSettings) -> APIRouter:
    api = APIRouter(dependencies=[Depends(api_key_check(settings))])
    name = settings.model_name or model.name

    def check(requested: str | None) -> None:
        if requested is not None and requested != name:
            raise APIError(404, f"The model `{requested}` does not exist", param="model", code="model_not_found")

    @api.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> JSONResponse:
        """The ids a completion's prompt or a chat's messages are served as, however many (400
        for what the template or the tokenizer refuses; 413 for a text that must be over the
        context, before it is tokenized)."""
        check(body.model)
        prompt, messages = body.prompt, body.messages
        if (prompt is None) == (messages is None):
            raise APIError(400, "send a prompt or messages", param="prompt")

        def ids() -> list[int]:
            if messages is not None:
                fields = body.model_dump(include=CHAT_FIELDS, exclude_unset=True)
                chat = ChatCompletionRequest.model_validate({"messages": messages, **fields})
                chat.check_supported()  # its tools' plan, as the chat endpoint makes it
                return chat.prompt_tokens(model).ids
            assert prompt is not None
            return CompletionRequest(model=body.model, prompt=prompt).prompt_tokens(model)[0].ids

        chars = len(prompt) if isinstance(prompt, str) else sum(len(m.text) for m in messages or ())
        try:
            tokens = ids() if chars <= INLINE_CHARS else await asyncio.to_thread(ids)
        except Exception as e:  # the template's or the tokenizer's refusal, as the API answers it
            return as_api_error(e, settings.retry_after_s).response()
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": model.max_model_len})

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> dict[str, str]:
        check(body.model)
        vocab = model.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        text = partial(model.tokenizer.decode, body.tokens, skip_special_tokens=False)
        return {"prompt": text() if len(body.tokens) <= INLINE_CHARS else await asyncio.to_thread(text)}

    return api

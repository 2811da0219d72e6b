"""A chat's messages as a request sends them, and as the model's chat template reads them:
{role, content} strings, an earlier answer's tool calls as that answer wrote them
(router/tools.py), the tools described in the system message."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jinja2
from pydantic import model_validator

from engine.errors import InvalidRequestError
from engine.tokenizer import Tokenizer
from router.bodies import StrictBody
from router.errors import REQUEST_ID
from router.tools import ToolPlan, history_text

log = logging.getLogger("tandem.router")


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class CalledFunction(StrictBody):
    name: str
    arguments: str  # JSON text


class ToolCallIn(StrictBody):
    """A call an earlier answer made (its `message.tool_calls`), sent back with the chat."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # none: an assistant's message that only called tools
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's: the call it answers

    @model_validator(mode="after")
    def _has_content(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant's message with tool_calls may leave it out)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant's message has tool_calls")
        return self

    @property
    def text(self) -> str:
        c = self.content
        return "" if c is None else c if isinstance(c, str) else "".join(p.text for p in c)

    def as_template_input(self, parallel: bool) -> dict[str, str]:
        """{role, content} for the chat template; an answer's calls as their JSON (`parallel`: as
        a request with parallel_tool_calls asks them written), without any text it also has: the
        format has no place for both, and an answer of this server's has one or the other."""
        role = "system" if self.role == "developer" else self.role
        if self.tool_calls:
            calls = [(c.function.name, c.function.arguments) for c in self.tool_calls]
            return {"role": role, "content": history_text(calls, parallel)}
        return {"role": role, "content": self.text}


def template_messages(messages: list[Message], plan: ToolPlan | None, parallel: bool) -> list[dict[str, str]]:
    """`messages` as the chat template reads them, with `plan`'s tools described in the system
    message (the first message's, where it is one; else one put first)."""
    out = [m.as_template_input(parallel) for m in messages]
    if plan is None:
        return out
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": f"{out[0]['content']}\n\n{plan.system_text}"}, *out[1:]]
    return [{"role": "system", "content": plan.system_text}, *out]


def render(
    tokenizer: Tokenizer,
    messages: Sequence[dict[str, str]],
    generation_prompt: bool,
    go_on: bool,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """The prompt: `messages` through the model's chat template, with the generation prompt or
    not; `go_on` (vLLM's continue_final_message): without it, and cut after the final message's
    text, so the answer goes on from there; `variables`: more for the template (vLLM's
    chat_template_kwargs and documents). InvalidRequestError (400) for what the template refuses
    or fails on, and for a final message the template does not render as it was sent."""
    try:
        text = tokenizer.apply_chat_template(messages, generation_prompt and not go_on, variables)
    except InvalidRequestError:
        raise
    except jinja2.TemplateError as e:
        log.info("request %s: the chat template failed: %r", REQUEST_ID.get(), e)
        why = f": {e.message}" if e.message else ""
        raise InvalidRequestError(f"the model's chat template rejected these messages{why}", "messages") from e
    except Exception as e:  # a template may fail in its own code (a TypeError in an expression)
        log.warning("request %s: the chat template failed", REQUEST_ID.get(), exc_info=e)
        raise InvalidRequestError("the model's chat template could not render these messages", "messages") from e
    if not go_on:
        return text
    final = messages[-1]["content"]
    at = text.rfind(final) if final else -1
    if at < 0:
        raise InvalidRequestError("continue_final_message: the final message is empty, or the chat template "
                                  "does not render its text as sent", "messages")  # fmt: skip
    return text[: at + len(final)]

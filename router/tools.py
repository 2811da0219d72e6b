"""Tool calling (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`) for any model, through
structured output: the tools are described in a system message, and the answer is held by a
grammar (engine/grammar.py) to one JSON object that names its calls, so it always parses.

    tool_choice "required", or a named function     {"tool_call": {"name": ..., "arguments": {...}}}
      ... with parallel_tool_calls true              {"tool_calls": [{"name": ..., "arguments": {...}}, ...]}
    tool_choice "auto" (the default with tools)     either, or {"response": "text for the user"}
    tool_choice "none"                               plain text; the tools are not described

One call an answer unless the request sends `parallel_tool_calls: true` (OpenAI's default is
true): held to a list, SmolLM2 kept appending calls (the same function again, other arguments)
until max_tokens cut the JSON short. tool_choice "required", 7 prompts x 2 tool sets, greedy,
120 tokens: cut short 9 of 14 as a list, 2 of 14 as one call (which made a call in the other
12). An agent loop gets its next call on its next turn.

Each call's `arguments` must match its function's `parameters` schema; a named function is the
only name allowed. The answer comes back as the message's `tool_calls` (finish_reason
"tool_calls"), or as its `content` where the model answered with a response. An answer cut
short (finish_reason "length", a stop string) is not JSON: it comes back as content, as it was.
Streamed, the answer is read as it is written (router/tool_stream.py).

This is llama.cpp's "generic" tool format. The served model's chat template (SmolLM2's) has no
tool syntax of its own, and a grammar-held answer needs no per-model parser. A conversation's
earlier calls are rendered back in the same JSON (router/chat_messages.py), so the model reads
the calls it made as it wrote them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from engine.grammar import MAX_SPEC_CHARS, Guide
from router.bodies import StrictBody
from router.errors import APIError

MAX_TOOLS = 128


class FunctionDef(StrictBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # OpenAI's label: the schema is always enforced here


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolCall:
    """One call of an answer: what `message.tool_calls` lists."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def body(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolAnswer:
    """An answer under a ToolPlan: its calls, or its text for the user (`content`)."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()

    def finish(self, finish_reason: str | None) -> str | None:
        return "tool_calls" if self.calls else finish_reason


@dataclass(frozen=True)
class ToolPlan:
    """What a request with tools asks of its answer: the system text that describes them, the
    grammar that holds the answer to calls of them, and how to read that answer back."""

    guide: Guide
    system_text: str

    def answer(self, text: str, finish_reason: str | None) -> ToolAnswer:
        """The calls in a finished answer's `text`; the text itself as content where it does not
        parse (cut short by a length or a stop string)."""
        if finish_reason not in ("stop", None):
            return ToolAnswer(text)
        try:
            obj = json.loads(text)
        except ValueError:
            return ToolAnswer(text)
        if not isinstance(obj, dict):
            return ToolAnswer(text)
        if isinstance(obj.get("response"), str):
            return ToolAnswer(obj["response"])
        calls = obj.get("tool_calls", [obj.get("tool_call")])
        if not isinstance(calls, list) or not calls or not all(_is_call(c) for c in calls):
            return ToolAnswer(text)
        return ToolAnswer(None, tuple(ToolCall(call_id(), c["name"], json.dumps(c["arguments"])) for c in calls))


def _is_call(c: Any) -> bool:
    return isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments"), dict)


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_plan(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool) -> ToolPlan | None:
    """The plan for a request's tools; None where its answer is plain text (no tools, or
    tool_choice "none"). APIError (400) for a choice that names no tool of the list, names
    that repeat, or tools too large to hold to."""
    if choice is not None and not tools and choice != "none":
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if not tools or choice == "none":
        return None
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"at most {MAX_TOOLS} tools a request (got {len(tools)})", param="tools")
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise APIError(400, "tools: each function needs a name of its own", param="tools")
    allowed = tools
    if isinstance(choice, NamedToolChoice):
        allowed = [t for t in tools if t.function.name == choice.function.name]
        if not allowed:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not in tools",
                           param="tool_choice")  # fmt: skip
    each = [_call_schema(t.function) for t in allowed]
    calls = {"anyOf": each} if len(each) > 1 else each[0]
    if parallel:
        schema: dict[str, Any] = _object(tool_calls={"type": "array", "items": calls, "minItems": 1})
    else:
        schema = _object(tool_call=calls)
    auto = choice in (None, "auto")
    if auto:
        schema = {"anyOf": [schema, _object(response={"type": "string"})]}
    spec = json.dumps(schema)
    if len(spec) > MAX_SPEC_CHARS:
        raise APIError(400, f"the tools' schemas come to over {MAX_SPEC_CHARS} characters", param="tools")
    return ToolPlan(Guide("json_schema", spec, field="tools"), _system_text(tools, allowed, parallel, auto))


def _call_schema(f: FunctionDef) -> dict[str, Any]:
    params = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
    if params.get("type", "object") != "object":
        raise APIError(400, f"tools: {f.name}'s parameters must be a schema of an object", param="tools")
    return _object(name={"const": f.name}, arguments=params)


def _object(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties)}


def _system_text(tools: list[Tool], allowed: list[Tool], parallel: bool, auto: bool) -> str:
    listed = "\n".join(json.dumps(t.function.model_dump(exclude_none=True, exclude={"strict"})) for t in tools)
    call = '{"name": "<function name>", "arguments": {<its arguments>}}'
    form = f'{{"tool_calls": [{call}, ...]}}' if parallel else f'{{"tool_call": {call}}}'
    which = "" if len(allowed) == len(tools) else f" Call {allowed[0].function.name}."
    reply = ', or {"response": "<your reply>"} to answer the user without a tool' if auto else ""
    return (f"You can call these functions (each with a JSON schema of its arguments):\n{listed}\n\n"
            f"Answer with one JSON object: {form} to call functions{reply}.{which}")  # fmt: skip


def history_text(calls: list[tuple[str, str]], parallel: bool) -> str:
    """An earlier answer's calls, (name, arguments JSON), as that answer wrote them.
    APIError (400) for arguments that are not a JSON object."""
    rendered = []
    for name, arguments in calls:
        try:
            args = json.loads(arguments)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise APIError(400, f"messages: the arguments of a call of {name} are not a JSON object", param="messages")
        rendered.append({"name": name, "arguments": args})
    if not parallel and len(rendered) == 1:
        return json.dumps({"tool_call": rendered[0]})
    return json.dumps({"tool_calls": rendered})

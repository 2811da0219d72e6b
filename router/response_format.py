"""What a request asks its answer to be, as the engine's Guide (structured output,
engine/grammar.py): OpenAI's `response_format`, or one of vLLM's `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar`."""

from __future__ import annotations

import json
from typing import Any

from engine.grammar import Guide
from router.errors import APIError


def guide_of(
    response_format: dict[str, Any] | None,
    guided_json: dict[str, Any] | str | None = None,
    guided_regex: str | None = None,
    guided_choice: list[str] | None = None,
    guided_grammar: str | None = None,
) -> Guide | None:
    """`response_format` {"type": "text"} or none: None; "json_object": any JSON object;
    "json_schema": JSON that `json_schema.schema` accepts (its `name` and `strict` are OpenAI's
    labels: the schema is always enforced). Or vLLM's: JSON of a schema (a dict or its text),
    text a regular expression matches, one of a list of strings, text an EBNF grammar derives.
    APIError (400) for another type, a missing schema, or two of them."""
    vllm = {"guided_json": guided_json, "guided_regex": guided_regex, "guided_choice": guided_choice,
            "guided_grammar": guided_grammar}  # fmt: skip
    asked = [k for k, v in vllm.items() if v is not None]
    fmt = response_format or {}
    kind = fmt.get("type", "text")
    if len(asked) + (kind != "text") > 1:
        one_of = "response_format, guided_json, guided_regex, guided_choice, guided_grammar"
        raise APIError(400, f"ask for one of {one_of}", param=asked[-1])
    if guided_json is not None:
        return Guide("json_schema", guided_json if isinstance(guided_json, str) else json.dumps(guided_json))
    if guided_regex is not None:
        return Guide("regex", guided_regex)
    if guided_choice is not None:
        return Guide.choice(guided_choice)
    if guided_grammar is not None:
        return Guide("grammar", guided_grammar, field="guided_grammar")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("json")
    if kind != "json_schema":
        raise APIError(400, f"response_format type {kind!r}: text, json_object or json_schema", param="response_format")
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise APIError(400, "response_format json_schema needs json_schema.schema, an object", param="response_format")
    return Guide("json_schema", json.dumps(schema))

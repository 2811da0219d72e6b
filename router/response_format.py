"""OpenAI's `response_format` as the engine's Guide (structured output, engine/grammar.py)."""

from __future__ import annotations

import json
from typing import Any

from engine.grammar import Guide
from router.errors import APIError


def guide_of(response_format: dict[str, Any] | None) -> Guide | None:
    """{"type": "text"} or none: None; "json_object": any JSON object; "json_schema": JSON that
    `json_schema.schema` accepts (its `name` and `strict` are OpenAI's labels: the schema is
    always enforced). APIError (400) for another type or a missing schema."""
    fmt = response_format or {}
    kind = fmt.get("type", "text")
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

"""`response_format` -> the JSON schema the engine constrains the answer to, checked here so
that a schema the grammar engine cannot use is a 400 naming the problem, before any engine."""
from __future__ import annotations

import json

from splitserve.api.openai_schema import ApiError
from splitserve.grammars import json_schema_grammar, xgrammar

ANY_OBJECT = '{"type": "object"}'  # json_object: any JSON object


def json_schema_for(response_format: dict | None) -> str | None:
    """None for free text; else the schema text (ApiError 400 if it is not usable)."""
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind != "json_schema":
        raise ApiError(400, f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
                       param="response_format.type")
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ApiError(400, "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                       param="response_format.json_schema")
    text = json.dumps(schema)
    check_schema(text)
    return text


def check_schema(text: str, param: str = "response_format.json_schema.schema") -> None:
    try:
        xgrammar()
    except ValueError:
        raise ApiError(400, "structured output is not supported on this server (xgrammar is not installed)",
                       param=param) from None
    try:
        json_schema_grammar(text)
    except ValueError as e:
        raise ApiError(400, str(e), param=param) from None

"""`/openapi.json` with the request bodies the routes read themselves (they parse JSON by hand to
name the offending field in a 400, so FastAPI cannot infer them). Clients and fuzzers
(schemathesis) generate requests from it."""

from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from plait.server.openai_protocol import ChatCompletionRequest, CompletionRequest

_SAMPLING = {
    "type": "object",
    "properties": {
        "max_new_tokens": {"type": "integer", "minimum": 0},
        "min_new_tokens": {"type": "integer", "minimum": 0},
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer"},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "frequency_penalty": {"type": "number"},
        "presence_penalty": {"type": "number"},
        "repetition_penalty": {"type": "number"},
        "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "ignore_eos": {"type": "boolean"},
        "skip_special_tokens": {"type": "boolean"},
        "spaces_between_special_tokens": {"type": "boolean"},
        "no_stop_trim": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 1},
        "seed": {"type": ["integer", "null"]},
        "regex": {"type": ["string", "null"]},
        "json_schema": {
            "type": ["object", "string", "null"],
            "description": "a JSON schema, or its JSON text",
        },
        "ebnf": {"type": ["string", "null"], "description": "a grammar: GBNF / EBNF or Lark"},
        "budget_closing": {
            "type": ["boolean", "null"],
            "description": "close the output on a valid end near max_new_tokens "
            "(null: the engine's setting)",
        },
        "closed_finish_reason": {
            "enum": ["length", "stop", None],
            "description": "the finish reason of an output budget-aware closing finished "
            "(null: the server's setting)",
        },
        "json_whitespace": {
            "enum": ["conventional", "compact", "flexible", None],
            "description": "how JSON under json_schema is spaced (null: the engine's setting)",
        },
        "token_healing": {
            "type": "boolean",
            "description": "back the prompt up over its last token; the output writes it again "
            "(cut from the text, reported as meta_info.healed_text)",
        },
    },
    "additionalProperties": False,
}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}

GENERATE = {
    "type": "object",
    "properties": {
        "text": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "input_ids": {"oneOf": [_IDS, {"type": "array", "items": _IDS}]},
        "sampling_params": {"oneOf": [_SAMPLING, {"type": "array", "items": _SAMPLING}]},
        "return_logprob": {"type": "boolean"},
        "logprob_start_len": {"type": "integer"},
        "top_logprobs_num": {"type": "integer", "minimum": 0},
        "return_text_in_logprobs": {"type": "boolean"},
        "stream": {"type": "boolean"},
        "rid": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "timeout": {
            "type": "number",
            "exclusiveMinimum": 0,
            "description": "seconds (504 past it)",
        },
    },
    "additionalProperties": False,
}
PROGRAM_RUN = {
    "type": "object",
    "properties": {
        "arguments": {"type": "object", "description": "the program's parameters by name"},
        "sampling": {"type": "object", "description": "gen() sampling defaults"},
        "stream": {"type": "boolean"},
    },
    "additionalProperties": False,
}
ABORT = {
    "type": "object",
    "properties": {"rid": {"type": "string"}, "abort_all": {"type": "boolean"}},
}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _build(app: FastAPI) -> dict[str, Any]:
    with warnings.catch_warnings():  # /flush_cache answers GET and POST with one function
        warnings.filterwarnings("ignore", message="Duplicate Operation ID")
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    bodies = {
        "/generate": GENERATE,
        "/v1/chat/completions": _model_schema(ChatCompletionRequest, components),
        "/v1/completions": _model_schema(CompletionRequest, components),
        "/programs/{name}": PROGRAM_RUN,
        "/abort_request": ABORT,
    }
    for path, body in bodies.items():
        operation = schema.get("paths", {}).get(path, {}).get("post")
        if operation is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": body}},
            }
    run = schema.get("paths", {}).get("/programs/{name}", {}).get("post")
    names = sorted(app.state.plait.programs)
    if run is not None and names:  # only registered programs run: say which
        for param in run.get("parameters", []):
            if param.get("name") == "name":
                param["schema"] = {**param.get("schema", {}), "enum": names}
    return schema


def _model_schema(model: Any, components: dict[str, Any]) -> dict[str, Any]:
    out = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(out.pop("$defs", {}))
    return out

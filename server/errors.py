"""Error responses: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every failure a client can cause is a 400 that names the offending field (413 / 431 for bodies and
headers past the limits); a full queue is a 503 with `Retry-After`; a request past its deadline a
504; anything else is a 500 that never leaks a traceback.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("plait.server")

_PARAM = re.compile(r"^([A-Za-z_][\w.\[\]]*)(?:, [A-Za-z_][\w.\[\]]*)*:")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "literal"})
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    503: "overloaded_error",
    504: "timeout_error",
}
MAX_JSON_DEPTH = 128  # nesting of arrays and objects in a request body
# A lone surrogate reaches a JSON string only as a \ud800-\udfff escape or as raw bytes ED A0-BF.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers or {}
        self.code = code  # OpenAI's error code where it has one; else the status

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code or self.status,
            }
        }
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400; `param` defaults to the field the message starts with (`"top_p: must be ..."`)."""
    return APIError(400, message, param=param_of(message) if param is None else param)


def param_of(message: str) -> str | None:
    match = _PARAM.match(message)
    return match.group(1) if match else None


def from_value_error(
    exc: ValueError, prefix: str = "", rename: dict[str, str] | None = None
) -> APIError:
    """The engine's `ValueError("field: reason")` as a 400 naming `prefix + field`; `rename`
    spells an engine field as the route's request calls it (`max_new_tokens` -> `max_tokens`)."""
    message = str(exc)
    param = param_of(message)
    if rename and param in rename:
        message = rename[param] + message[len(param) :]
        param = param_of(message)
    if prefix and param:
        message, param = prefix + message, prefix + param
    return APIError(400, message, param=param)


def model_not_found(model: str, served: str) -> APIError:
    """A request for a model this server does not serve (OpenAI's and vLLM's 404)."""
    return APIError(
        404,
        f"model: the model `{model}` does not exist; this server serves `{served}`",
        param="model",
        code="model_not_found",
    )


def queue_full(limit: int, retry_after: int = 1) -> APIError:
    return APIError(
        503,
        f"the server is at capacity ({limit} requests running or queued); retry later",
        headers={"Retry-After": str(retry_after)},
    )


def format_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """The first pydantic error as `loc: message` (e.g. `messages.0.role: Input should be ...`)."""
    first = exc.errors()[0]
    parts = [str(p) for p in first.get("loc", ())]
    if isinstance(exc, RequestValidationError) and parts[:1] == ["body"]:
        parts = parts[1:]
    # NOTE: union members add their type to `loc` ("str", "list[str]", "NamedToolChoice",
    # "literal['a','b']"); drop those so the path is the field's own. An unknown field's own
    # name comes last and is kept whatever it looks like.
    named = len(parts) - 1 if first.get("type") == "extra_forbidden" else len(parts)
    loc = [p for i, p in enumerate(parts) if i == named or not _is_type_tag(p)]
    param = ".".join(loc) if loc else None
    message = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        message = "unknown field; remove it (this server does not support it)"
    if "input" in first and first.get("type") not in ("missing", "extra_forbidden"):
        shown = json.dumps(first["input"], default=str)
        message += f", got {shown[:200]}"
    return APIError(400, message if param is None else f"{param}: {message}", param=param)


def _is_type_tag(part: str) -> bool:
    return part in _TYPE_TAGS or part[:1].isupper() or any(c in part for c in "[('-")


def parse_model(model: type[BaseModel], body: Any, prefix: str = "") -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = format_validation_error(exc)
        if prefix:
            err.param = prefix + (err.param or "")
            err.message = prefix + err.message
        raise err from None


def from_abort(reason: dict[str, Any]) -> APIError:
    """An engine abort as the HTTP error it stands for (its `status_code`; else 400 for a refused
    request, 500 for an internal error)."""
    message = reason.get("message") or "the request was aborted"
    status = reason.get("status_code")
    if status is None:
        status = 500 if message.startswith("internal error") else 400
    param = "timeout" if status == 504 else None
    return APIError(status, message, param=param)


async def read_json(request: Request) -> Any:
    """The body as JSON, or a 400 saying why it is not (a 413 past the size limit)."""
    limit = _body_limit(request)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if limit is not None and size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        raise APIError(400, "body: expected a JSON object, got an empty body", param="body")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"body: invalid JSON: {e}", param="body") from None
    except RecursionError:
        body = None
    if body is None or _too_deep(body, MAX_JSON_DEPTH):
        raise APIError(400, f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels", param="body")
    # NOTE: JSON may escape half of a surrogate pair alone; such a string cannot be tokenized
    # (nor written back into an error message), so it is refused here, by its path.
    bad = _invalid_unicode(body) if _MAYBE_SURROGATE.search(raw) else None
    if bad is not None:
        raise APIError(400, f"{bad}: not valid Unicode (a lone surrogate escape)", param=bad)
    return body


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"body: larger than the server's limit of {limit} bytes", param="body")


def _body_limit(request: Request) -> int | None:
    state = getattr(request.app.state, "plait", None)
    return None if state is None else state.config.max_body_bytes


def _too_deep(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                return True
            children = node.values() if isinstance(node, dict) else node
            stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _invalid_unicode(value: Any) -> str | None:
    """The path (`messages.0.content`) of the first string or key holding a lone surrogate."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if not _encodable(node):
                return _shown_path(path)
        elif isinstance(node, dict):
            for key, child in node.items():
                if not _encodable(key):
                    return _shown_path((*path, key))
                stack.append((child, (*path, key)))
        elif isinstance(node, list):
            stack.extend(
                (c, (*path, i)) for i, c in enumerate(node) if isinstance(c, (str, dict, list))
            )
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown_path(path: tuple[Any, ...]) -> str:
    return ".".join(str(p).encode("utf-8", "backslashreplace").decode() for p in path) or "body"


async def read_object(request: Request) -> dict[str, Any]:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise APIError(
            400, f"body: expected a JSON object, got {type(body).__name__}", param="body"
        )
    return body


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        state = getattr(request.app.state, "plait", None)
        if state is not None:
            state.metrics.errors.labels(str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await _api_error(request, format_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"{request.url.path}: no such route"
        return await _api_error(request, APIError(exc.status_code, message, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return await _api_error(
            request, APIError(500, f"internal error: {type(exc).__name__}: {exc}")
        )

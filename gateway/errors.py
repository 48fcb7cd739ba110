"""OpenAI-style errors: one exception type and one set of FastAPI handlers.

Every error leaves the server as
`{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}`.
Edges raise `APIError` (or a plain ValueError "param: message", which maps to a
400 naming `param`); `install_error_handlers(app)` turns them into responses and
makes the OpenAPI document say so (400, never FastAPI's 422).
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from formwork.gateway.openapi_doc import document_request_bodies
from formwork.schemas.errors import ParamError, param_of
from formwork.schemas.openai_base import ErrorInfo, ErrorResponse, InvalidBodyError

log = logging.getLogger("formwork.gateway")

FASTAPI_BODY_ERROR = "There was an error parsing the body"     # FastAPI's 400, cause chained


class APIError(Exception):
    retry_after_s: int | None = None

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorInfo(
            message=self.message, type=self.type, param=self.param, code=self.code))
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        if self.retry_after_s is not None:
            headers = {"Retry-After": str(self.retry_after_s)}
        return JSONResponse(body.model_dump(), status_code=self.status, headers=headers)


class EngineDeadError(APIError):
    """503 with Retry-After: the engine is down (being restarted, or gone)."""

    def __init__(self, message: str = "The engine is not running; retry later.",
                 retry_after_s: int = 5) -> None:
        super().__init__(503, message, type="service_unavailable_error", code="engine_unavailable")
        self.retry_after_s = retry_after_s
        self.after_send = False        # the engine died holding the request (gateway/engine_client.py)
        self.before_output = False     # ... and it had yielded nothing: it may be sent again


class ServerShuttingDownError(APIError):
    """503 with Retry-After: the server got SIGTERM. New requests get it at once;
    requests still running when the drain timeout ends get it instead of their end."""

    def __init__(self, message: str = "The server is shutting down; retry later "
                                      "(another replica may take the request).") -> None:
        super().__init__(503, message, type="service_unavailable_error",
                         code="server_shutting_down")
        self.retry_after_s = 5


class TooManyWaitingError(APIError):
    """429 with Retry-After: more requests are waiting than `--max-waiting-requests`."""

    def __init__(self, limit: int) -> None:
        super().__init__(429, f"The server is overloaded: {limit} requests are already in "
                              "flight or waiting (formwork serve --max-num-seqs plus "
                              "--max-waiting-requests); retry later.",
                         type="rate_limit_error", code="too_many_waiting_requests")
        self.retry_after_s = 1


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def invalid_json(detail: str) -> APIError:
    """400 for the body as a whole (not JSON, not an object, not UTF-8, nested too deep)."""
    return bad_request("We could not parse the JSON body of your request (expected a JSON object "
                       f"sent as application/json): {detail}", code="invalid_json")


def _parse_failure(cause: BaseException | None) -> str:
    """What made FastAPI's JSON parse fail, in words."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"the body is not valid UTF-8 (byte 0x{cause.object[cause.start]:02x} at "
                f"offset {cause.start}: {cause.reason})")
    if isinstance(cause, RecursionError):
        return "the body is nested too deeply"
    return f"{type(cause).__name__}: {cause}" if cause is not None else "unreadable body"


def from_value_error(err: ValueError, *, param_prefix: str = "") -> APIError:
    """A ValueError -> 400 with `param` set (prefixed by `param_prefix`): a
    ParamError's own field; for another ValueError the "param: message" form of its
    text (libraries' and pydantic's errors)."""
    text = str(err)
    param = param_of(err)
    if param:
        if param_prefix and not param.startswith(param_prefix):
            param = f"{param_prefix}{param}"
    return bad_request(text, param=param)


def _loc_to_param(loc: tuple, prefix: str = "") -> str | None:
    parts = [str(p) for p in loc if p != "body" and not _is_union_tag(p)]
    if not prefix:
        if not parts:
            return None
        prefix, parts = parts[0], parts[1:]
    out = prefix
    for p in parts:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def describe_validation_errors(errors: list[dict], prefix: str = "") -> tuple[str | None, str]:
    """(param, message) for pydantic's `errors()` of a value under `prefix`: the
    first error, a union's tries counted as one."""
    first = errors[0] if errors else {}
    param = _loc_to_param(tuple(first.get("loc", ())), prefix)
    msg = first.get("msg", "invalid request")
    text, covered = (f"{param}: {msg}" if param else msg), 1
    if (union := _union_error(errors, prefix)) is not None:
        param, text, covered = union
    if len(errors) > covered:
        text += f" (and {len(errors) - covered} more error(s))"
    return param, text


# pydantic puts the union member it tried into an error's loc (`stop.str`,
# `tool_choice.literal['none','auto','required']`, `tool_choice.NamedToolChoice`);
# a client's field has none of these: lower-case names and list indices.
_PRIMITIVES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
               "none": "null"}


def _is_union_tag(p) -> bool:
    return isinstance(p, str) and ("[" in p or p in _PRIMITIVES or p[:1].isupper())


def _describe_member(tag: str) -> str:
    if tag in _PRIMITIVES:
        return _PRIMITIVES[tag]
    if tag.startswith("literal[") and tag.endswith("]"):
        values = tag[len("literal["):-1].split(",")
        return values[0] if len(values) == 1 else "one of " + ", ".join(values)
    if tag.startswith("list[") and tag.endswith("]"):
        inner = tag[len("list["):-1]
        if inner.startswith("dict[") or inner[:1].isupper():
            return "a list of objects"
        if inner in _PRIMITIVES:
            return "a list of " + {"str": "strings", "int": "integers", "float": "numbers",
                                   "bool": "booleans", "none": "nulls"}[inner]
        return "a list of " + {"list[int]": "lists of integers",
                               "list[str]": "lists of strings"}.get(inner, "lists")
    return "an object"       # a model class or a dict


def _union_error(errors: list[dict], prefix: str = "") -> tuple[str, str, int] | None:
    """(param, message, errors it covers) where the first error is a union's: the
    branch that got furthest into the value, else what the union takes."""
    locs = [tuple(p for p in e.get("loc", ()) if p != "body") for e in errors]
    at = next((i for i, p in enumerate(locs[0]) if _is_union_tag(p)), None)
    if at is None:
        return None
    field = locs[0][:at]
    group = [(e, loc) for e, loc in zip(errors, locs)
             if loc[:at] == field and len(loc) > at and _is_union_tag(loc[at])]
    param = _loc_to_param(field, prefix) or "body"
    # how far into the value each try got (a tagged union nests its tag: not depth)
    depths = sorted(((sum(not _is_union_tag(p) for p in loc[at + 1:]), i)
                     for i, (_, loc) in enumerate(group)), reverse=True)
    if depths[0][0] >= 1 and (len(depths) == 1 or depths[1][0] < depths[0][0]):
        best, loc = group[depths[0][1]]   # the branch the value's shape matched
        where = _loc_to_param(loc, prefix) or param
        return where, f"{where}: {best.get('msg', 'invalid value')}", len(group)
    members: list[str] = []
    for _, loc in group:
        if (d := _describe_member(loc[at])) not in members:
            members.append(d)
    takes = members[0] if len(members) == 1 else \
        ", ".join(members[:-1]) + " or " + members[-1]
    return param, f"{param}: must be {takes}, got {_json_type(group[0][0].get('input'))}", \
        len(group)


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    param = _loc_to_param(tuple(first.get("loc", ())))
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, ParamError):         # a whole-body check naming its field
        return bad_request(str(cause), param=cause.param).to_response()
    if isinstance(cause, InvalidBodyError):
        return invalid_json(str(cause)).to_response()
    if first.get("type") == "json_invalid" or param is None:
        # the body as a whole: not JSON, not an object, sent without a JSON content type
        detail = first.get("ctx", {}).get("error") or first.get("msg", "invalid JSON")
        if first.get("type") == "missing":
            detail = "the body is empty"
        return invalid_json(detail).to_response()
    param, text = describe_validation_errors(errors)
    return bad_request(text, param=param).to_response()


def parse_body(cls, body: dict):
    """`body` (a route's JSON object) read as the pydantic model `cls`, failing as a
    request body FastAPI reads does: a 400 naming the field."""
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])}
                                      for err in e.errors()]) from None


def _counted(request: Request, response: JSONResponse) -> JSONResponse:
    count_error(request.app, response.status_code)
    return response


def count_error(app, status: int) -> None:
    """formwork_request_errors_total{status} of the server running `app` (none in
    apps built without one, as in-process tests do). ASGI middlewares pass
    scope.get("app"): their refusals (413, 429, 503) never reach a handler."""
    server = getattr(getattr(app, "state", None), "server", None)
    if server is not None:
        server.metrics.observe_error(status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _counted(request, exc.to_response())

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _counted(request, _validation_error(request, exc))

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        return _counted(request, from_value_error(exc).to_response())

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == FASTAPI_BODY_ERROR:
            return _counted(request, invalid_json(_parse_failure(exc.__cause__)).to_response())
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None
        response = APIError(exc.status_code, str(exc.detail), type=kind, code=code).to_response()
        response.headers.update(exc.headers or {})       # 405 says Allow
        return _counted(request, response)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return APIError(500, f"Internal server error: {type(exc).__name__}: {exc}",
                        type="server_error").to_response()

    fastapi_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = fastapi_openapi()             # FastAPI caches it in app.openapi_schema
            document_errors(document)
            document_request_bodies(document)
        return app.openapi_schema

    app.openapi = openapi


def document_errors(schema: dict) -> None:
    """Make an OpenAPI document (in place) say what the handlers above answer: an
    invalid request is a 400 ErrorResponse, not FastAPI's 422 HTTPValidationError,
    and any other error status has the same shape."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(error_schema.pop("$defs", {}))
    components["ErrorResponse"] = error_schema
    content = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            responses = operation.setdefault("responses", {})
            if responses.pop("422", None) is not None:
                responses["400"] = {"description": "Invalid request", "content": content}
            responses["default"] = {"description": "Error", "content": content}
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)

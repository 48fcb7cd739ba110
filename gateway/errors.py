"""OpenAI-style errors: one exception type and one set of FastAPI handlers.

Every error leaves the server as
`{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}`.
Edges raise `APIError` (or a plain ValueError "param: message", which maps to a
400 naming `param`); `install_error_handlers(app)` turns them into responses.
"""
from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from formwork.schemas.openai import ErrorInfo, ErrorResponse, FieldValueError

log = logging.getLogger("formwork.gateway")

PARAM_PREFIX = re.compile(r"^([A-Za-z_][\w\.\[\]]*): ")


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


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(err: ValueError, *, param_prefix: str = "") -> APIError:
    """A ValueError "param: message" -> 400 with `param` set (prefixed by `param_prefix`)."""
    text = str(err)
    m = PARAM_PREFIX.match(text)
    param = None
    if m:
        param = m.group(1)
        if param_prefix and not param.startswith(param_prefix):
            param = f"{param_prefix}{param}"
    return bad_request(text, param=param)


def _loc_to_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    param = _loc_to_param(tuple(first.get("loc", ())))
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, FieldValueError):         # a whole-body check naming its field
        return bad_request(str(cause), param=cause.param).to_response()
    if first.get("type") == "json_invalid" or param is None:
        # the body as a whole: not JSON, not an object, sent without a JSON content type
        detail = first.get("ctx", {}).get("error") or first.get("msg", "invalid JSON")
        if first.get("type") == "missing":
            detail = "the body is empty"
        return bad_request(
            "We could not parse the JSON body of your request (expected a JSON object "
            f"sent as application/json): {detail}", code="invalid_json").to_response()
    msg = first.get("msg", "invalid request")
    text = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error(s))"
    return bad_request(text, param=param).to_response()


def _counted(request: Request, response: JSONResponse) -> JSONResponse:
    server = getattr(request.app.state, "server", None)
    if server is not None:
        server.metrics.observe_error(response.status_code)
    return response


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
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None
        return APIError(exc.status_code, str(exc.detail), type=kind, code=code).to_response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return APIError(500, f"Internal server error: {type(exc).__name__}: {exc}",
                        type="server_error").to_response()

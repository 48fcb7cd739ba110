"""Request-size limits that act before any parsing or tokenizing, so an oversized
request is refused in milliseconds and never holds the event loop.

- `BodyLimitMiddleware`: a body over `max_bytes` -> 413, from Content-Length at
  once, or while a chunked body streams in.
- `check_text_fits`: a prompt whose characters cannot fit the context even at
  the tokenizer's longest token -> 400 context_length_exceeded without
  tokenizing (a 20 MB message took 30 s to tokenize before it was refused).
"""
from __future__ import annotations

from collections.abc import Iterable

from starlette.exceptions import HTTPException as StarletteHTTPException

from formwork.gateway.errors import APIError, count_error

DEFAULT_MAX_BODY_MB = 8.0


class _TooLarge(StarletteHTTPException):
    """Raised from `receive` inside the app: an HTTPException, so FastAPI's body
    reader passes it on (other errors there become a generic 400)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, _too_large(max_bytes).message)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"Request body too large: the limit is {max_bytes} bytes "
                         "(formwork serve --max-request-body-mb).",
                    code="request_too_large")


class BodyLimitMiddleware:
    """Pure ASGI (streaming responses untouched)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            count_error(scope.get("app"), 413)
            return await _too_large(self.max_bytes).to_response()(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(self.max_bytes)
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            count_error(scope.get("app"), 413)
            await _too_large(self.max_bytes).to_response()(scope, receive, send)


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` decodes to."""
    n = len(tokenizer)
    return max(1, max(len(t) for t in tokenizer.batch_decode([[i] for i in range(n)])))


def truncated_prompt(ids: list[int], k: int | None, max_model_len: int,
                     side: str | None = None) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the last k prompt tokens (-1: max_model_len),
    the first k with `side` (truncation_side) "right"; 400 naming the field for 0,
    below -1 or above max_model_len."""
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    if k < 1 or k > max_model_len:
        raise APIError(400, f"truncate_prompt_tokens: must be -1 (the context length) or in "
                            f"[1, {max_model_len}], got {k}", param="truncate_prompt_tokens")
    return ids[:k] if side == "right" else ids[-k:]


def check_text_fits(texts: Iterable[str], max_model_len: int, max_token_chars: int,
                    param: str) -> None:
    """400 when the texts need more than max_model_len tokens for sure: every token
    covers at most `max_token_chars` characters, so chars / that is a lower bound."""
    chars = sum(len(t) for t in texts)
    if chars > max_model_len * max_token_chars:
        raise APIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, "
                 f"your {param} has {chars} characters, more than {max_model_len} tokens can "
                 f"hold. Please reduce the length of the {param}.",
            param=param, code="context_length_exceeded")

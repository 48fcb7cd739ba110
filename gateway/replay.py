"""Sending a request again when its engine died before it produced anything:
the one retry loop of EngineClient (to the restarted engine) and DPEngineClient
(to another engine that is up)."""
from __future__ import annotations

import contextlib
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from formwork.gateway.errors import EngineDeadError

T = TypeVar("T")


async def replaying(attempt: Callable[[], AsyncIterator[T]],
                    retry: Callable[[EngineDeadError], Awaitable[bool]]) -> AsyncIterator[T]:
    """Yield from `attempt()`. When it ends with EngineDeadError raised after the
    request reached an engine (`after_send`) and before anything was yielded, the
    error gets `before_output` set and, if `retry(error)` says so, `attempt()`
    runs once more; otherwise the error propagates."""
    tried_again = False
    while True:
        produced = False
        try:
            async with contextlib.aclosing(attempt()) as gen:
                async for item in gen:
                    produced = True
                    yield item
            return
        except EngineDeadError as e:
            e.before_output = not produced and e.after_send
            if not e.before_output or tried_again or not await retry(e):
                raise
            tried_again = True

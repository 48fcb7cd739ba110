"""Admission in front of the routes: a bound on the generation requests in flight
(429 over it) and the drain of a graceful shutdown (503 for new requests while
those in flight finish).

Owns: the counts of HTTP requests in flight and the draining flag. Counted in a
pure ASGI middleware around the whole request, so a streamed response counts
until its last byte, and every way out (finished, error, client gone,
cancelled) gives its place back.
"""
from __future__ import annotations

import asyncio

from formwork.gateway.errors import ServerShuttingDownError, TooManyWaitingError, count_error

GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/invocations")
OPEN_WHILE_DRAINING = ("/health", "/ping", "/metrics", "/version", "/load")
DEFAULT_MAX_WAITING = 1024
DEFAULT_DRAIN_TIMEOUT_S = 30.0


def max_generating(max_num_seqs: int, max_waiting: int) -> int | None:
    """Generation requests allowed in flight: the engine runs up to max_num_seqs at
    once, so beyond that they wait. None (no bound) when max_waiting is 0."""
    if max_waiting < 0:
        raise ValueError(f"max_waiting_requests: must be >= 0 (0: no limit), got {max_waiting}")
    return None if max_waiting == 0 else max_num_seqs + max_waiting


class Admission:
    """`limit`: generation requests in flight at once (None: no bound)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.generating = 0          # POSTs to GENERATE_PATHS in flight
        self.in_flight = 0           # every HTTP request in flight
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def admit(self, path: str, method: str) -> bool:
        """Count a request in (True: a generation request); raises the refusal."""
        if self.draining and path not in OPEN_WHILE_DRAINING:
            raise ServerShuttingDownError()
        generate = method == "POST" and path in GENERATE_PATHS
        if generate and self.limit is not None and self.generating >= self.limit:
            raise TooManyWaitingError(self.limit)
        self.generating += generate
        self.in_flight += 1
        self._idle.clear()
        return generate

    def release(self, generate: bool) -> None:
        self.generating -= generate
        self.in_flight -= 1
        assert self.generating >= 0 and self.in_flight >= 0
        if self.in_flight == 0:
            self._idle.set()

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests from now on; True once none is in flight, False when
        `timeout_s` passed first."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True


class AdmissionMiddleware:
    """Pure ASGI (streaming and its cancellation untouched)."""

    def __init__(self, app, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            generate = self.admission.admit(scope.get("path", ""), scope.get("method", ""))
        except (ServerShuttingDownError, TooManyWaitingError) as refusal:
            count_error(scope.get("app"), refusal.status)
            return await refusal.to_response()(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.release(generate)

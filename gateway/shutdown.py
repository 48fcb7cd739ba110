"""How the server ends.

SIGTERM drains (gateway/admission.py counts what is in flight): new requests
get 503 while those in flight finish, for up to the drain timeout; the rest
then end with a 503 error (JSON, or an SSE error event and [DONE]); uvicorn
then stops the app (its lifespan stops the engine) and the server exits 0.
An engine that cannot be restarted ends the process at once with
FATAL_EXIT_CODE, for an outside supervisor to start it again.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Awaitable, Callable

import uvicorn
from fastapi import FastAPI

from formwork.gateway.admission import Admission
from formwork.gateway.errors import ServerShuttingDownError
from formwork.gateway.serving import ServerState

log = logging.getLogger("formwork.gateway")
FATAL_EXIT_CODE = 3
ENDED_FLUSH_S = 5.0      # after the drain timeout: for the ended requests' error responses


def exit_for_supervisor() -> None:
    """The engine could not be restarted: exit non-zero at once (an outside
    supervisor -- systemd, Kubernetes -- starts the server again)."""
    log.critical("the engine cannot be restarted; the server exits (code %d)", FATAL_EXIT_CODE)
    logging.shutdown()
    os._exit(FATAL_EXIT_CODE)


async def drain(app: FastAPI, timeout_s: float) -> None:
    """Graceful shutdown: new requests get 503; those in flight have `timeout_s` to
    finish, then the rest end with ServerShuttingDownError."""
    admission: Admission = app.state.admission
    state: ServerState | None = getattr(app.state, "server", None)
    log.info("SIGTERM: draining %d requests in flight (new ones get 503) for up to %.0f s",
             admission.in_flight, timeout_s)
    if state is not None:
        state.engine.stop_restarts()
    if await admission.drain(timeout_s):
        return
    log.warning("drain timeout: ending the %d requests still in flight", admission.in_flight)
    if state is not None:
        state.engine.end_requests(lambda: ServerShuttingDownError(
            f"The server is shutting down: the request was still running after the "
            f"{timeout_s:g} s drain timeout."))
    await admission.drain(ENDED_FLUSH_S)


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM runs `on_sigterm()` (the drain) while it
    still listens, then exits as after any SIGTERM but with status 0. A second
    SIGTERM or a SIGINT is uvicorn's usual exit."""

    def __init__(self, config: uvicorn.Config, on_sigterm: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._on_sigterm = on_sigterm
        self._drain: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        """A signal handler: runs on the main thread, which runs the event loop."""
        if sig != signal.SIGTERM or self._drain is not None or self.should_exit:
            return super().handle_exit(sig, frame)
        if not self.started:
            self.should_exit = True              # still starting: nothing to drain
            return
        asyncio.get_running_loop().call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.create_task(self._drain_then_exit(), name="drain")

    async def _drain_then_exit(self) -> None:
        try:
            await self._on_sigterm()
        except Exception:  # noqa: BLE001 - the exit goes on; the requests left are cut
            log.exception("the drain failed")
        finally:
            self.should_exit = True

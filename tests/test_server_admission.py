"""Admission in front of the routes (issue 13), in-process and without a model:
the bound on generation requests in flight (429 with Retry-After, the place given
back on every way out) and the drain of a graceful shutdown (503 for new
requests, /health says "draining", the drain waits for the requests in flight)."""
from __future__ import annotations

import asyncio
import signal
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from formwork.gateway.admission import Admission, AdmissionMiddleware, max_generating
from formwork.gateway.shutdown import DrainingServer
from formwork.gateway.cli import main
from formwork.gateway.errors import install_error_handlers

CHAT = "/v1/chat/completions"


def _app(admission: Admission, gate: asyncio.Event) -> FastAPI:
    """Generation routes that hold until `gate` is set: "fail" raises, "stream" streams."""
    app = FastAPI()
    install_error_handlers(app)
    app.state.server = SimpleNamespace(metrics=ErrorCounts())

    @app.post(CHAT)
    async def chat(request: Request):
        body = await request.json()
        if body.get("fail"):
            raise ValueError("temperature: must be >= 0")
        if body.get("stream"):
            async def chunks():
                yield "data: first\n\n"
                await gate.wait()
                yield "data: [DONE]\n\n"
            return StreamingResponse(chunks(), media_type="text/event-stream")
        await gate.wait()
        return {"ok": True}

    @app.post("/tokenize")
    async def tokenize():
        return {"tokens": []}

    @app.get("/health")
    async def health():
        return {"status": "ready"}

    app.add_middleware(AdmissionMiddleware, admission=admission)
    return app


class ErrorCounts:
    """Stands in for the server's metrics: formwork_request_errors_total by status."""

    def __init__(self) -> None:
        self.by_status: dict[int, int] = {}

    def observe_error(self, status: int) -> None:
        self.by_status[status] = self.by_status.get(status, 0) + 1


def _client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def _until(predicate, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("max_num_seqs,max_waiting,limit", [(4, 2, 6), (256, 1024, 1280), (4, 0, None)])
def test_limit_is_running_plus_waiting(max_num_seqs, max_waiting, limit):
    assert max_generating(max_num_seqs, max_waiting) == limit


def test_negative_limits_are_refused_before_start():
    assert main(["serve", "--max-waiting-requests", "-1"]) == 2
    assert main(["serve", "--drain-timeout", "-5"]) == 2
    assert main(["serve", "--max-engine-restarts", "-1"]) == 2
    assert main(["serve", "--engine-restart-backoff", "0"]) == 2


def test_over_the_limit_is_429_and_every_way_out_gives_the_place_back():
    async def run() -> None:
        admission, gate = Admission(2), asyncio.Event()
        app = _app(admission, gate)
        async with _client(app) as client:
            held = [asyncio.create_task(client.post(CHAT, json={})) for _ in range(2)]
            await _until(lambda: admission.generating == 2)
            r = await client.post(CHAT, json={})
            assert r.status_code == 429 and r.headers["Retry-After"] == "1"
            assert r.json() == {"error": {
                "message": r.json()["error"]["message"], "type": "rate_limit_error",
                "param": None, "code": "too_many_waiting_requests"}}
            assert "--max-waiting-requests" in r.json()["error"]["message"]
            assert app.state.server.metrics.by_status == {429: 1}     # counted in /metrics
            assert (await client.post("/tokenize", json={})).status_code == 200  # not generation
            held[0].cancel()                                 # the client goes away
            await asyncio.gather(held[0], return_exceptions=True)
            await _until(lambda: admission.generating == 1)
            failed = await client.post(CHAT, json={"fail": True})      # an error response
            assert failed.status_code == 400 and admission.generating == 1
            gate.set()
            assert (await held[1]).status_code == 200                  # finished normally
            assert (await client.post(CHAT, json={"stream": True})).status_code == 200
            assert admission.generating == 0 and admission.in_flight == 0

    asyncio.run(run())


def test_unlimited_admits_everything():
    async def run() -> None:
        admission, gate = Admission(None), asyncio.Event()
        async with _client(_app(admission, gate)) as client:
            held = [asyncio.create_task(client.post(CHAT, json={})) for _ in range(50)]
            await _until(lambda: admission.generating == 50)
            gate.set()
            assert {(await h).status_code for h in held} == {200}

    asyncio.run(run())


def test_drain_refuses_new_requests_and_waits_for_those_in_flight():
    async def run() -> None:
        admission, gate = Admission(None), asyncio.Event()
        async with _client(_app(admission, gate)) as client:
            held = asyncio.create_task(client.post(CHAT, json={}))
            await _until(lambda: admission.in_flight == 1)
            assert not await admission.drain(0.05)            # still in flight: timed out
            r = await client.post(CHAT, json={})
            assert r.status_code == 503 and r.headers["Retry-After"] == "5"
            assert r.json()["error"]["code"] == "server_shutting_down"
            assert r.json()["error"]["type"] == "service_unavailable_error"
            assert (await client.get("/health")).status_code == 200   # open while draining
            draining = asyncio.create_task(admission.drain(5.0))
            await asyncio.sleep(0.05)
            assert not draining.done()
            gate.set()
            assert (await held).status_code == 200 and await draining

    asyncio.run(run())


def test_first_sigterm_drains_then_exits_without_re_raising():
    """The first SIGTERM runs the drain while the server still serves; the exit that
    follows is clean (uvicorn would re-raise the signal: exit status -15)."""
    async def run() -> None:
        drained = asyncio.Event()

        async def on_sigterm() -> None:
            await asyncio.sleep(0.05)
            drained.set()

        server = DrainingServer(uvicorn.Config(FastAPI()), on_sigterm=on_sigterm)
        server.started = True
        server.handle_exit(signal.SIGTERM, None)
        assert not server.should_exit
        await asyncio.wait_for(drained.wait(), 5)
        await asyncio.sleep(0.01)
        assert server.should_exit and server._captured_signals == []
        server.handle_exit(signal.SIGTERM, None)          # a second one: uvicorn's exit
        assert server._captured_signals == [signal.SIGTERM]

    asyncio.run(run())

"""`formwork serve --data-parallel-size 2` end to end on the default model: a
mixed run of 200 requests (plain, streamed, json_schema-constrained,
completions) each answered exactly once with both engines used; kill -9 of
one engine fails only its own requests while the other serves, and the dead
engine comes back and gets requests again."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import jsonschema
import pytest

from test_server import KEY, Server, metrics

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {KEY}"}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    s = Server("--data-parallel-size", "2", "--kv-cache-memory-gb", "0.25",
               "--max-model-len", "512", "--max-num-seqs", "16", "--dtype", "float32")
    yield s
    assert s.stop(signal.SIGTERM) == 0, s.logs()


def routed(server) -> list[float]:
    m = metrics(server)
    return [sum(v for k, v in m.items() if k.startswith("formwork_dp_requests_routed_total{")
                and f'engine="{i}"' in k) for i in (0, 1)]


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def _body(i: int) -> tuple[str, dict]:
    """Request i of the mixed run: (path, body)."""
    kind = i % 4
    if kind == 3:          # a prompt of its own: its first block is new (routed by load)
        return "/v1/completions", {"prompt": f"{i} {i} {i} is a number; " * 3, "max_tokens": 4,
                                   "n": 2 if i % 5 == 0 else 1}
    body = {"messages": [{"role": "user", "content": f"Give me the number {i}."}],
            "max_tokens": 4}
    if kind == 1:
        body["stream"] = True
    if kind == 2:
        body.update(max_tokens=32, temperature=0, response_format={"type": "json_schema", "json_schema": {
            "name": "n", "schema": SCHEMA}})
    return "/v1/chat/completions", body


async def _one(client: httpx.AsyncClient, i: int) -> dict:
    path, body = _body(i)
    if not body.get("stream"):
        r = await client.post(path, json=body)
        assert r.status_code == 200, (i, r.text)
        out = r.json()
        choice = out["choices"][0]
        if "response_format" in body:
            assert choice["finish_reason"] == "stop", (i, choice)
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        assert len(out["choices"]) == body.get("n", 1)
        return {"id": out["id"], "finish": [c["finish_reason"] for c in out["choices"]]}
    events = []
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, i
        async for line in r.aiter_lines():
            if line:
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, (i, events[-3:])
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), (i, chunks[-1])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"] and c["choices"][0].get("finish_reason")]
    assert len({c["id"] for c in chunks}) == 1
    return {"id": chunks[0]["id"], "finish": finishes}


def test_mixed_run_every_request_answered_once_on_both_engines(server):
    before = routed(server)

    async def main() -> list[dict]:
        gate = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as client:
            async def run(i: int) -> dict:
                async with gate:
                    return await _one(client, i)
            return await asyncio.gather(*(run(i) for i in range(200)))

    results = asyncio.run(main())
    assert len(results) == 200 and len({r["id"] for r in results}) == 200
    assert all(len(r["finish"]) == _body(i)[1].get("n", 1) and None not in r["finish"]
               for i, r in enumerate(results))
    after = routed(server)
    got = [a - b for a, b in zip(after, before)]
    assert sum(got) == 200 and all(n > 0 for n in got), got        # both engines served
    m = metrics(server)
    # chat prompts share their first block (the template's system turn): affinity
    assert sum(v for k, v in m.items() if k.startswith("formwork_dp_requests_routed_total{")
               and 'reason="affinity"' in k) > 0
    assert all(m[f'formwork_dp_requests_in_flight{{engine="{i}"}}'] == 0 for i in (0, 1))
    assert all(m[f'formwork_dp_outstanding_tokens{{engine="{i}"}}'] == 0 for i in (0, 1))
    assert m['formwork_dp_engine_up{engine="0"}'] == m['formwork_dp_engine_up{engine="1"}'] == 1
    h = health(server)
    assert h["status"] == "ready" and [e["state"] for e in h["engines"]] == ["ready", "ready"]


class _Stream:
    """A streamed completion read on a thread; `first` is set once it flows;
    `leave` set: the client disconnects after its first event."""

    def __init__(self, server: Server, i: int, max_tokens: int = 120) -> None:
        self.events: list[str] = []
        self.first, self.leave = threading.Event(), threading.Event()
        body = {"prompt": f"Story {i}: once upon a time, " * 3, "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True}
        self.thread = threading.Thread(target=self._run, args=(server, body), daemon=True)
        self.thread.start()

    def _run(self, server: Server, body: dict) -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    self.events.append(line)
                    self.first.set()
                if self.leave.is_set():
                    break
        self.first.set()

    def failed(self) -> bool:
        return any('"engine_unavailable"' in e for e in self.events)


def test_client_disconnects_abort_on_the_right_engine(server):
    """Clients that leave mid-stream: their requests end on the engine that held them
    (the engines report nothing running) and the router's counters go back to 0."""
    streams = [_Stream(server, 100 + i, max_tokens=400) for i in range(4)]
    assert all(s.first.wait(60) for s in streams)
    assert all(e["requests"] > 0 for e in health(server)["engines"])
    for s in streams:
        s.leave.set()
    for s in streams:
        s.thread.join(60)
    deadline = time.monotonic() + 30
    keys = [f'formwork_dp_{name}{{engine="{i}"}}' for i in (0, 1)
            for name in ("requests_in_flight", "outstanding_tokens", "engine_num_requests_running",
                         "engine_num_requests_waiting")]
    while any((m := metrics(server)).get(k, 1) != 0 for k in keys):
        assert time.monotonic() < deadline, {k: m.get(k) for k in keys}
        time.sleep(0.2)
    assert all(len(s.events) < 400 for s in streams)       # left long before the end


def test_killed_engine_fails_only_its_requests_and_comes_back(server):
    assert health(server)["status"] == "ready"
    streams = [_Stream(server, i) for i in range(6)]
    assert all(s.first.wait(60) for s in streams)
    h = health(server)
    held = [e["requests"] for e in h["engines"]]
    assert held[0] > 0 and held[1] > 0, h             # distinct prompts: spread by load
    victim = h["engines"][0]["pid"]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (h := health(server))["engines"][0]["state"] == "ready":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert h["status"] == "ready"                     # the other engine serves on
    # while engine 0 restarts, new requests go to engine 1 and succeed
    for i in range(3):
        r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                       json={"prompt": f"{i} while one engine is down, " * 3, "max_tokens": 3})
        assert r.status_code == 200, r.text
    for s in streams:
        s.thread.join(120)
        assert s.events[-1] == "data: [DONE]", s.events[-3:]
    failed = [s.failed() for s in streams]
    assert sum(failed) == held[0], (failed, held)     # exactly the dead engine's requests
    for s in streams:
        if not s.failed():
            finish = json.loads(s.events[-2][len("data: "):])["choices"][0]["finish_reason"]
            assert finish == "length"
    # engine 0 comes back (new pid) and gets requests again
    while (h := health(server))["engines"][0]["state"] != "ready":
        assert time.monotonic() < deadline + 60, server.logs()
        time.sleep(0.2)
    assert h["engines"][0]["restarts"] == 1 and h["engines"][0]["pid"] != victim
    assert h["engine_restarts"] == 1
    before = routed(server)[0]
    for i in range(4):          # idle engines, new prefixes: a tie goes to engine 0
        r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                       json={"prompt": f"{i} after the restart, " * 3, "max_tokens": 3})
        assert r.status_code == 200, r.text
    assert routed(server)[0] > before

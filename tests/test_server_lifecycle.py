"""Server process lifecycle on a tiny random-weight model: engine death -> 503,
an engine that outlives a killed server exits on its own, a SIGTERM to the
whole process group does not hang the shutdown, a SIGTERM drains the requests
in flight, too many waiting requests get 429, and a server whose engine cannot
be restarted exits non-zero."""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time

import httpx
import psutil
import pytest

from formwork.core.ipc import IPC_PREFIX
from formwork.gateway.constraint_check import PROCESS_NAME
from formwork.gateway.shutdown import FATAL_EXIT_CODE
from test_server import KEY, Server, gone, metrics

pytestmark = pytest.mark.slow


def _tiny_server(tiny_model_dir, *args: str, **kw) -> Server:
    """`args` come last: they override the defaults here."""
    return Server(str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "64",
                  "--max-model-len", "256", "--max-num-seqs", "4",
                  "--served-model-name", "tiny", *args, **kw)


def _engine_pid(server: Server) -> int:
    """The EngineCore: the server's spawned child that is not its constraint checker."""
    kids = psutil.Process(server.proc.pid).children()
    return next(k.pid for k in kids if "spawn_main" in " ".join(k.cmdline())
                and k.name() != PROCESS_NAME.decode())


def test_engine_death_gives_503_then_the_engine_comes_back(tiny_model_dir):
    """kill -9 of the EngineCore: in-flight and new requests get a clean 503 with
    Retry-After, /health says "restarting", and the gateway starts a new engine:
    serving again well within 30 s, twice in a row."""
    server = _tiny_server(tiny_model_dir)
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        long = {**body, "max_tokens": 200, "ignore_eos": True, "stream": True}
        auth = {"Authorization": f"Bearer {KEY}"}
        ok = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.json() == {"status": "ready", "engine_restarts": 0}
        for restart in (1, 2):
            old = _engine_pid(server)
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=long,
                              headers=auth, timeout=60) as stream:
                lines = (x for x in stream.iter_lines() if x)
                # the role chunk, then tokens: the request has produced output (one
                # that had not would be sent again to the new engine)
                assert all(next(lines).startswith("data: ") for _ in range(3))
                os.kill(old, signal.SIGKILL)
                rest = list(lines)
            assert any('"engine_unavailable"' in x for x in rest), rest[-3:]   # an error event
            assert rest[-1] == "data: [DONE]"
            killed = time.monotonic()
            r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth, timeout=60)
            if r.status_code == 503:
                assert r.json()["error"]["type"] == "service_unavailable_error"
                assert r.headers["Retry-After"].isdigit()
                h = httpx.get(f"{server.url}/health", timeout=10)
                assert h.status_code in (200, 503) and h.json()["status"] in ("restarting", "ready")
            while httpx.get(f"{server.url}/health", timeout=10).status_code != 200:
                assert time.monotonic() - killed < 30, server.logs()[-3000:]
                time.sleep(0.2)
            assert httpx.get(f"{server.url}/health", timeout=10).json()["engine_restarts"] == restart
            assert _engine_pid(server) != old
            again = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth,
                               timeout=60)
            assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(f"{server.url}/v1/models", headers=auth).status_code == 200
    finally:
        rc = server.stop(signal.SIGTERM)
    assert rc == 0, server.logs()                     # SIGTERM drains, then exits 0
    assert "Application shutdown complete" in server.logs()


def test_requests_queued_at_an_engine_death_are_served_by_the_new_engine(tiny_model_dir):
    """kill -9 while one request runs and three wait in the engine's queue
    (max_num_seqs 1): the running stream gets the 503 error event, the queued ones,
    which had produced nothing, are sent again to the restarted engine and succeed."""
    # the real model: its stream lasts long enough for the three to queue behind it
    server = Server("--max-num-seqs", "1", "--max-model-len", "512", "--kv-cache-memory-gb",
                    "0.25", "--served-model-name", "tiny")
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "ignore_eos": True}
    try:
        results: list[httpx.Response] = []

        def queued(i: int) -> None:
            results.append(httpx.post(f"{server.url}/v1/chat/completions", headers=auth, timeout=120,
                                      json={**body, "messages": [{"role": "user", "content": f"q{i}"}]}))

        long = {**body, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=long, headers=auth,
                          timeout=120) as stream:
            lines = (x for x in stream.iter_lines() if x)
            assert all(next(lines).startswith("data: ") for _ in range(3))    # tokens flow
            threads = [threading.Thread(target=queued, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while metrics(server).get('vllm:num_requests_waiting{model_name="tiny"}', 0) < 3:
                assert time.monotonic() < deadline, "the three never queued"
                time.sleep(0.05)
            os.kill(_engine_pid(server), signal.SIGKILL)
            rest = list(lines)
        assert any('"engine_unavailable"' in x for x in rest), rest[-3:]
        for t in threads:
            t.join(120)
        assert [r.status_code for r in results] == [200, 200, 200], [r.text for r in results]
        assert all(r.json()["usage"]["completion_tokens"] == 4 for r in results)
        assert httpx.get(f"{server.url}/health", timeout=10).json()["engine_restarts"] == 1
    finally:
        server.stop(signal.SIGTERM)


def test_engine_exits_when_server_is_killed(tiny_model_dir):
    server = _tiny_server(tiny_model_dir)
    engine = _engine_pid(server)
    server.stop(signal.SIGKILL)
    assert gone(engine, timeout_s=15), "engine kept running after its parent was killed"


def test_sigterm_to_the_process_group_exits_cleanly(tiny_model_dir):
    """As `systemctl stop` or a terminal's job control: server and engine get SIGTERM together."""
    server = _tiny_server(tiny_model_dir, new_session=True)
    engine = _engine_pid(server)
    os.killpg(server.proc.pid, signal.SIGTERM)
    try:
        rc = server.proc.wait(60)
    except Exception:
        server.stop(signal.SIGKILL)
        raise AssertionError(f"server hung after a process-group SIGTERM:\n{server.logs()}")
    assert rc == 0, server.logs()
    assert gone(engine, timeout_s=15)


AUTH = {"Authorization": f"Bearer {KEY}"}
# ~1 s of decoding each on two CPU cores; n=4 ~4 s (--max-num-seqs 1: one after another)
LONG = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 450,
        "ignore_eos": True}
ONE_AT_A_TIME = ("--max-num-seqs", "1", "--max-model-len", "512", "--num-kv-blocks", "128")


def _chat(server: Server, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH,
                      timeout=timeout)


class _Stream:
    """A streamed chat request whose first event has been read; close() leaves."""

    def __init__(self, server: Server, body: dict) -> None:
        self.client = httpx.Client(timeout=120)
        self.response = self.client.send(self.client.build_request(
            "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True},
            headers=AUTH), stream=True)
        assert self.response.status_code == 200, self.response.read()
        self.lines = self.response.iter_lines()
        assert next(self.lines).startswith("data: ")

    def rest(self) -> list[str]:
        """The remaining events' data, to the end of the stream."""
        return [x[len("data: "):] for x in self.lines if x]

    def close(self) -> None:
        self.response.close()
        self.client.close()


class _Queued:
    """A streamed chat request sent on a bare socket and never read: one that waits in
    the queue (a stream's headers go out with its first output, so an HTTP client would
    block here until it ran); close() leaves."""

    def __init__(self, server: Server, body: dict) -> None:
        data = json.dumps({**body, "stream": True}).encode()
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        self.sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: {AUTH['Authorization']}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode() + data)

    def close(self) -> None:
        self.sock.close()


def _ipc_dirs(pid: int) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"{IPC_PREFIX}{pid}-*"))


def _until(predicate, timeout_s: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_too_many_waiting_requests_get_429_and_every_place_comes_back(tiny_model_dir):
    """--max-num-seqs 1 --max-waiting-requests 1: two requests in flight, the third gets
    429 with Retry-After at once; a client that leaves and refused requests give
    their place back."""
    server = _tiny_server(tiny_model_dir, *ONE_AT_A_TIME, "--max-waiting-requests", "1")
    try:
        endless = {**LONG, "n": 64}            # ~1 min: ends only when its client leaves
        for _ in range(2):                 # the second round finds every place free again
            a, b = _Stream(server, endless), _Queued(server, endless)
            _until(lambda: _chat(server, {**LONG, "temperature": -1}).status_code == 429,
                   what="the queued request never took its place")
            r = _chat(server, {**LONG, "max_tokens": 1})
            assert r.status_code == 429 and r.headers["Retry-After"].isdigit(), r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "too_many_waiting_requests" and err["type"] == "rate_limit_error"
            assert _chat(server, {**LONG, "temperature": -1}).status_code == 429
            a.close()                          # the client goes away: its place comes back
            _until(lambda: _chat(server, {**LONG, "temperature": -1}).status_code == 400,
                   what="a disconnected stream kept its place")
            for _ in range(3):                     # refused requests do not keep one
                assert _chat(server, {**LONG, "temperature": -1}).status_code == 400
            b.close()
            _until(lambda: metrics(server).get("formwork_num_requests_running", 1) == 0,
                   what="the engine kept running an aborted request")
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.logs()


def _in_flight_then_sigterm(server: Server):
    """A streamed (n=4) and a plain long request in flight, the plain one waiting behind
    the streamed one; then SIGTERM. Returns (the stream, the plain one's thread, its
    result {"r": response} once the thread ends)."""
    stream = _Stream(server, {**LONG, "n": 4})
    plain: dict = {}
    thread = threading.Thread(target=lambda: plain.update(r=_chat(server, LONG, timeout=120)))
    thread.start()
    _until(lambda: metrics(server).get("formwork_num_requests_waiting") == 1,
           what="the plain request never reached the engine")
    server.proc.send_signal(signal.SIGTERM)
    return stream, thread, plain


def _exited_cleanly(server: Server, engine: int, ipc: list[str]) -> None:
    assert server.proc.wait(60) == 0, server.logs()
    assert "Application shutdown complete" in server.logs()
    assert gone(engine, timeout_s=15)
    assert len(ipc) == 1 and not os.path.exists(ipc[0])


def test_sigterm_drains_requests_in_flight_then_exits_0(tiny_model_dir):
    """SIGTERM with a long drain timeout: new requests get 503 (and /health says
    "draining") while the two in flight run to their end; then exit 0, the engine
    and its IPC folder gone."""
    server = _tiny_server(tiny_model_dir, *ONE_AT_A_TIME, "--drain-timeout", "120")
    try:
        engine, ipc = _engine_pid(server), _ipc_dirs(server.proc.pid)
        stream, thread, plain = _in_flight_then_sigterm(server)
        _until(lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 503)
        assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "draining"
        refused = _chat(server, {**LONG, "max_tokens": 1})
        assert refused.status_code == 503 and refused.headers["Retry-After"].isdigit()
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert thread.is_alive(), "the requests in flight ended before the refusal was checked"
        events = stream.rest()
        stream.close()
        # an error event has a top-level "error" (the random model's text may hold the word)
        assert events[-1] == "[DONE]" and not any("error" in json.loads(e) for e in events[:-1]), \
            events[-3:]
        finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"]]
        assert finishes[-1] == "length"
        thread.join(120)
        assert plain["r"].status_code == 200, plain["r"].text
        assert plain["r"].json()["usage"]["completion_tokens"] == LONG["max_tokens"]
        _exited_cleanly(server, engine, ipc)
    finally:
        server.stop(signal.SIGKILL)


def test_sigterm_ends_what_outlives_the_drain_timeout_with_errors(tiny_model_dir):
    """--drain-timeout 0: the streamed request ends with an error event and [DONE], the
    plain one with a 503 error JSON; then exit 0, the engine and its IPC folder gone."""
    server = _tiny_server(tiny_model_dir, *ONE_AT_A_TIME, "--drain-timeout", "0")
    try:
        engine, ipc = _engine_pid(server), _ipc_dirs(server.proc.pid)
        stream, thread, plain = _in_flight_then_sigterm(server)
        events = stream.rest()
        stream.close()
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "server_shutting_down" and "drain timeout" in error["message"]
        thread.join(60)
        assert plain["r"].status_code == 503, plain["r"].text
        assert plain["r"].json()["error"]["code"] == "server_shutting_down"
        _exited_cleanly(server, engine, ipc)
    finally:
        server.stop(signal.SIGKILL)


def test_exits_non_zero_when_the_engine_cannot_be_restarted(tiny_model_dir, tmp_path):
    """The engine dies and its model is gone: after the restart limit (here
    --max-engine-restarts 3, backoff 0.2+0.4+0.8 s: the defaults, 5 and 1 s, would
    wait 31 s) the server exits with FATAL_EXIT_CODE, so that an outside supervisor
    takes over; the log shows the three attempts."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    server = _tiny_server(model, "--max-engine-restarts", "3", "--engine-restart-backoff", "0.2")
    try:
        shutil.rmtree(model)                 # every restart now fails to load the model
        os.kill(_engine_pid(server), signal.SIGKILL)
        _until(lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 503)
        rc = server.proc.wait(240)
        assert rc == FATAL_EXIT_CODE != 0, server.logs()
        logs = server.logs()
        assert "cannot be restarted" in logs and "failed 3 restarts in a row" in logs, logs
        assert "restarting engine in 0.2 s (restart 1)" in logs and "in 0.8 s (restart 3)" in logs
    finally:
        server.stop(signal.SIGKILL)

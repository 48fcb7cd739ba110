"""Server process lifecycle on a tiny random-weight model: engine death -> 503,
an engine that outlives a killed server exits on its own, and a SIGTERM to the
whole process group does not hang the shutdown."""
from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from test_server import KEY, Server, gone

pytestmark = pytest.mark.slow


def _tiny_server(tiny_model_dir, **kw) -> Server:
    return Server(str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "64",
                  "--max-model-len", "256", "--max-num-seqs", "4",
                  "--served-model-name", "tiny", **kw)


def _engine_pid(server: Server) -> int:
    kids = psutil.Process(server.proc.pid).children()
    return next(k.pid for k in kids if "spawn_main" in " ".join(k.cmdline()))


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
                lines = stream.iter_lines()
                assert next(lines).startswith("data: ")          # the stream is flowing
                os.kill(old, signal.SIGKILL)
                rest = [x for x in lines if x]
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
    assert rc in (0, -signal.SIGTERM), server.logs()
    assert "Application shutdown complete" in server.logs()


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
    assert rc in (0, -signal.SIGTERM), server.logs()
    assert gone(engine, timeout_s=15)

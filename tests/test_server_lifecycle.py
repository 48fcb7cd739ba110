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


def test_engine_death_gives_503_then_clean_exit(tiny_model_dir):
    server = _tiny_server(tiny_model_dir)
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        auth = {"Authorization": f"Bearer {KEY}"}
        ok = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        os.kill(_engine_pid(server), signal.SIGKILL)
        deadline = time.monotonic() + 20
        while httpx.get(f"{server.url}/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "health still 200 after the engine died"
            time.sleep(0.2)
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "service_unavailable_error"
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

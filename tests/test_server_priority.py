"""`formwork serve --scheduling-policy priority`: a request with a lower `priority`
(vLLM's request field, sent as the openai SDK's extra_body) is served before the
requests already queued and takes the seat of a running one, on a real server
with one seat."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from test_server import KEY, Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    s = Server("--max-model-len", "512", "--max-num-seqs", "1", "--scheduling-policy", "priority")
    yield s
    s.stop()


def _body(max_tokens: int, **extra) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Count to a hundred."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


async def _race(url: str) -> dict[str, float]:
    done: dict[str, float] = {}
    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 headers={"Authorization": f"Bearer {KEY}"}) as c:
        async def send(name: str, delay: float, body: dict) -> None:
            await asyncio.sleep(delay)
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]
            done[name] = time.monotonic()
        await asyncio.gather(send("bulk0", 0.0, _body(48)), send("bulk1", 0.3, _body(16)),
                             send("bulk2", 0.4, _body(16)),
                             send("urgent", 0.8, _body(4, priority=-1)))
    return done


def test_a_lower_priority_value_is_served_before_the_queue(server):
    done = asyncio.run(_race(server.url))
    # the one seat: bulk0 (48 tokens) gives it to urgent and resumes after it
    assert done["urgent"] < done["bulk0"] < done["bulk1"] < done["bulk2"], done
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, extra_body={"priority": 3})
    assert r.usage.completion_tokens <= 2

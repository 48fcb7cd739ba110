"""`formwork serve --scheduling-policy priority`: a request with a lower `priority`
(vLLM's request field, sent as the openai SDK's extra_body) is served before the
requests already queued and takes the seat of a running one, on a real server
with one seat."""
from __future__ import annotations

import asyncio
import json
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
    """bulk0 streams a long answer; once its first token is out (it holds the seat)
    bulk1 and bulk2 queue behind it, then urgent comes: no wall-clock guess of how far
    bulk0 got (a fast box once finished 48 tokens before urgent was sent)."""
    done: dict[str, float] = {}
    seated = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 headers={"Authorization": f"Bearer {KEY}"}) as c:
        async def send(name: str, body: dict) -> None:
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]
            done[name] = time.monotonic()

        async def long_stream() -> None:
            body = {**_body(400), "stream": True, "stream_options": {"include_usage": True}}
            usage = None
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        seated.set()
                    usage = chunk.get("usage") or usage
            assert usage["completion_tokens"] == 400
            done["bulk0"] = time.monotonic()

        async def the_rest() -> None:
            await seated.wait()
            first = asyncio.create_task(send("bulk1", _body(16)))
            await asyncio.sleep(0.1)
            second = asyncio.create_task(send("bulk2", _body(16)))
            await asyncio.sleep(0.2)
            await asyncio.gather(first, second, send("urgent", _body(4, priority=-1)))
        await asyncio.gather(long_stream(), the_rest())
    return done


def test_a_lower_priority_value_is_served_before_the_queue(server):
    done = asyncio.run(_race(server.url))
    # the one seat: bulk0 (400 tokens) gives it to urgent and resumes after it
    assert done["urgent"] < done["bulk0"] < done["bulk1"] < done["bulk2"], done
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, extra_body={"priority": 3})
    assert r.usage.completion_tokens <= 2

"""A stream whose request fails in the engine before any output (here: every grammar
compile past a 1 ms `--grammar-compile-timeout`) is answered with that error's HTTP
status and OpenAI-shaped body, as the same request unstreamed is, not with a 200 and
an error event: the response starts with the first output. Chat, completions
(several prompts) and Responses; the openai SDK raises BadRequestError at `create`.
And a streamed completions choice sends its finish chunk once."""
from __future__ import annotations

import itertools
import json

import httpx
import openai
import pytest

from test_server import KEY, Server, metrics

AUTH = {"Authorization": f"Bearer {KEY}"}
_fresh = itertools.count()


def regex() -> dict:
    """A constraint never compiled before (a compiled grammar is cached) and large
    enough that no backend compiles it within 1 ms (a small regex can be)."""
    k = next(_fresh)
    return {"structured_outputs": {"regex": "|".join(f"w{k}x{i}" for i in range(2000))}}


def schema() -> dict:
    k = next(_fresh)
    return {"type": "object", "properties": {f"n{k}_{i}": {"type": "integer"} for i in range(80)},
            "required": [f"n{k}_{i}" for i in range(80)]}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = Server("--model", str(tiny_model_dir), "--max-model-len", "512", "--kv-cache-memory-gb",
               "0.1", "--dtype", "float32", "--served-model-name", "m",
               "--grammar-compile-timeout", "0.001")
    yield s
    s.stop()


def _post(server, path: str, body: dict) -> tuple[httpx.Response, list[str]]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, headers=AUTH,
                      timeout=60) as r:
        lines = [x for x in r.iter_lines() if x]
    return r, lines


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", lambda: {"messages": [{"role": "user", "content": "hi"}], **regex()},
     "structured_outputs"),
    ("/v1/completions", lambda: {"prompt": ["a", "b"], **regex()}, "structured_outputs"),
    ("/v1/completions", lambda: {"prompt": "a", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema()}}},
     "response_format"),
    ("/v1/responses", lambda: {"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": schema()}}}, "text.format"),
])
def test_an_engine_error_before_any_output_is_the_streams_status(server, path, body, param):
    def request() -> dict:
        b = {"model": "m", "max_tokens": 4, **body()}
        if path == "/v1/responses":
            b["max_output_tokens"] = b.pop("max_tokens")
        return b
    plain = httpx.post(f"{server.url}{path}", json=request(), headers=AUTH, timeout=60)
    r, lines = _post(server, path, {**request(), "stream": True})
    assert r.status_code == plain.status_code == 400, lines
    assert r.headers["content-type"].startswith("application/json")
    error = json.loads(lines[0])["error"]
    assert error == plain.json()["error"]
    assert error["param"] == param and "grammar compilation took longer" in error["message"]


def test_streams_that_produce_output_are_unchanged_and_nothing_is_left_running(server):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": ["a", "b c"], "n": 2})):
        r, lines = _post(server, path, {"model": "m", "max_tokens": 3, "stream": True, **body})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert lines[-1] == "data: [DONE]" and not any('"error"' in x for x in lines)
        events = [json.loads(x[6:]) for x in lines[:-1]]
        finished = [c for e in events for c in e["choices"] if c.get("finish_reason")]
        assert len(finished) == (1 if path == "/v1/chat/completions" else 4)
    m = metrics(server)
    assert m["formwork_num_requests_running"] == 0 and m["formwork_num_requests_waiting"] == 0


def test_the_openai_sdk_raises_at_create(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, stream=True, extra_body=regex())
    assert info.value.body["param"] == "structured_outputs"


def test_a_stream_left_before_its_first_output_is_aborted(tiny_model_dir):
    """With the engine's one seat taken, a streamed request waits in its queue for its
    first output; its client leaving then aborts it (nothing left waiting, no KV block
    held once the seat's request is done)."""
    import threading
    import time

    s = Server("--model", str(tiny_model_dir), "--max-model-len", "512", "--kv-cache-memory-gb",
               "0.1", "--dtype", "float32", "--served-model-name", "m", "--max-num-seqs", "1")
    try:
        long = {"model": "m", "prompt": "a", "max_tokens": 480, "ignore_eos": True}
        seat = threading.Thread(target=httpx.post, args=(f"{s.url}/v1/completions",),
                                kwargs={"json": long, "headers": AUTH, "timeout": 120})
        seat.start()
        deadline = time.monotonic() + 30
        while metrics(s).get("formwork_num_requests_running", 0) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(httpx.ReadTimeout):   # no headers: it waits for its first output
            with httpx.stream("POST", f"{s.url}/v1/completions", headers=AUTH,
                              timeout=httpx.Timeout(60, read=0.5),
                              json={"model": "m", "prompt": "b", "max_tokens": 5, "stream": True}):
                pass
        deadline = time.monotonic() + 10
        while metrics(s).get("formwork_num_requests_waiting", 0) != 0:   # aborted when left
            assert time.monotonic() < deadline, "the left request still waits"
            time.sleep(0.05)
        assert metrics(s)["formwork_num_requests_running"] == 1           # the seat's, going on
        seat.join(120)
        m = metrics(s)
        assert m["formwork_num_requests_running"] == 0 and m["formwork_kv_cache_held_blocks"] == 0
    finally:
        s.stop()


def test_a_completions_choice_finishes_once_when_its_siblings_go_on():
    """n=2: the output processor snapshots all of a request's choices each step, so a
    choice that finished is in every later output; its finish chunk goes out once (it
    went out again, with empty text, whenever the choices finished in different steps)."""
    import asyncio

    from formwork.gateway.metrics import Metrics
    from formwork.gateway.output_processor import CompletionOutput, RequestOutput
    from formwork.gateway.serving import ServerState
    from formwork.gateway.serving_completion import PreparedCompletion, _stream
    from formwork.schemas.sampling import SamplingParams

    def out(index, text, new, reason=None):
        return CompletionOutput(index=index, text=text, token_ids=list(range(len(text))),
                                finish_reason=reason, delta_text=new,
                                delta_token_ids=[0] * len(new))

    steps = [[out(0, "a", "a"), out(1, "b", "b")],
             [out(0, "ab", "b", "length"), out(1, "bc", "c")],
             [out(0, "ab", "", "length"), out(1, "bcd", "d")],
             [out(0, "ab", "", "length"), out(1, "bcde", "e", "stop")]]

    async def outputs():
        for k, outs in enumerate(steps):
            yield 0, RequestOutput("r", "p", [1], outs, finished=k == len(steps) - 1)

    async def run():
        state = ServerState(engine=None, tokenizer=None, served_model_names=("m",),
                            max_model_len=64, metrics=Metrics("m"))
        prep = PreparedCompletion("m", [("p", [1])], [SamplingParams(n=2, max_tokens=4)], None,
                                  n=2)
        return [e async for e in _stream(state, prep, outputs(), "cmpl-1", False, False)]

    events = [json.loads(e[6:]) for e in asyncio.run(run()) if e != "data: [DONE]\n\n"]
    choices = [c for e in events for c in e["choices"]]
    assert [(c["index"], c["finish_reason"]) for c in choices if c["finish_reason"]] == \
        [(0, "length"), (1, "stop")]
    assert "".join(c["text"] for c in choices if c["index"] == 0) == "ab"
    assert "".join(c["text"] for c in choices if c["index"] == 1) == "bcde"

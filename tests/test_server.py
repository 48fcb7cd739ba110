"""End-to-end tests of the real server process with the real default model,
through the official `openai` client (one server for the whole module).

Greedy SmolLM2-135M loops easily: schemas are bounded (maxLength, maxItems,
enum) and a "length" finish is accepted, but every "stop" output must validate
and each test needs at least one "stop" so that it cannot pass vacuously.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from enum import Enum

import httpx
import jsonschema
import openai
import psutil
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "test-key"
CLI = (sys.executable, "-m", "formwork.gateway.cli")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, api_key: str | None = KEY, timeout_s: float = 600,
                 new_session: bool = False, formwork: tuple[str, ...] = CLI, cwd: str = ROOT,
                 env: dict[str, str] | None = None) -> None:
        """`formwork serve *args` on a free loopback port; `formwork` is the command that
        stands for the console script (default: this interpreter's `-m` of it); `env`:
        variables set beside this process's."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="formwork-server-", suffix=".log")
        cmd = [*formwork, "serve", *args, "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "info"] + (["--api-key", api_key] if api_key else [])
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=new_session)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.logs()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout_s} s:\n{self.logs()}")

    def logs(self) -> str:
        self.log.seek(0)
        return self.log.read()[-6000:]

    def child_pids(self) -> list[int]:
        """All descendants (the engine and multiprocessing's resource tracker); asserts
        that the engine is among them."""
        kids = psutil.Process(self.proc.pid).children(recursive=True)
        assert any("spawn_main" in " ".join(k.cmdline()) for k in kids), "no engine process"
        return [k.pid for k in kids]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def small_server_client(*extra: str):
    """A fixture's body: a small `formwork serve` on loopback and an openai client of it
    (the server stops when the fixture ends)."""
    s = Server("--max-model-len", "1024", "--max-num-seqs", "8", "--kv-cache-memory-gb", "0.5",
               *extra)
    try:
        yield openai.OpenAI(base_url=f"{s.url}/v1", api_key=KEY, max_retries=0, timeout=300)
    finally:
        s.stop()


def gone(pid: int, timeout_s: float = 30) -> bool:
    """True once `pid` no longer runs (exited and reaped, or a zombie)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def server():
    # the qwen3 reasoning parser reads an output without <think> as content: every other
    # test here sees plain outputs unchanged; the reasoning test below opens a <think>
    s = Server("--max-model-len", "1024", "--max-num-seqs", "64", "--kv-cache-memory-gb", "1",
               "--reasoning-parser", "qwen3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(default_model_dir))


def metrics(server) -> dict[str, float]:
    """Unlabelled samples plus `name{labels}` keys, from the Prometheus text."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def finish_reason_total(m: dict, reason: str) -> float:
    return sum(v for k, v in m.items()
               if k.startswith("formwork_request_success_total") and f'finished_reason="{reason}"' in k)


ASK = [{"role": "user", "content": "What is the capital of France?"}]


# ---- plain chat ---------------------------------------------------------------------------

def test_chat_plain_usage_matches_template(client, model, tokenizer):
    r = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=24)
    c = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length") and not c.message.tool_calls
    want = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True)
    want = want if isinstance(want, list) else want["input_ids"]
    assert r.usage.prompt_tokens == len(want)
    assert r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if c.finish_reason == "length":
        assert r.usage.completion_tokens == 24
    assert "Paris" in c.message.content


def test_return_token_ids_chat(server, tokenizer):
    """vLLM's return_token_ids: the templated prompt's ids and each choice's output ids
    (eos included, as usage counts it); streamed, the prompt's in the first chunk and
    the new ids per chunk, adding up to the non-streamed ids, also where a chunk shows
    no text (a tool call being parsed, a constrained output); absent unless asked."""
    want = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True)
    want = want if isinstance(want, list) else want["input_ids"]
    body = {"model": "SmolLM2-135M-Instruct", "messages": ASK, "temperature": 0, "max_tokens": 12, "n": 2,
            "return_token_ids": True}
    r = _post(server, body).json()
    assert r["prompt_token_ids"] == want
    for c in r["choices"]:
        assert len(c["token_ids"]) <= 12 and c["message"]["content"] == tokenizer.decode(
            c["token_ids"], skip_special_tokens=True)
    assert r["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in r["choices"])
    plain = _post(server, {**body, "return_token_ids": False}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}}
    for extra in ({"tools": [tool], "tool_choice": "required"},
                  {"response_format": {"type": "json_object"}}, {}):
        one = {**body, "n": 1, "max_tokens": 24, **extra}
        whole = _post(server, one).json()
        events = [json.loads(line[6:]) for line in _post(server, {**one, "stream": True}).text
                  .splitlines() if line.startswith("data: {")]
        assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]
        assert all("prompt_token_ids" not in e for e in events[1:])
        streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
        assert streamed == whole["choices"][0]["token_ids"], extra


def test_stream_equals_non_stream_and_format(client, model, server):
    kw = dict(model=model, messages=ASK, temperature=0, max_tokens=16)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    raw = httpx.post(f"{server.url}/v1/chat/completions", json={**kw, "stream": True},
                     headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    events = [e for e in raw.text.split("\n\n") if e]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert "usage" not in json.loads(events[0][6:])


def test_logprobs_and_n(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=5,
                                       logprobs=True, top_logprobs=3, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content   # greedy
    lps = r.choices[0].logprobs.content
    assert len(lps) == r.usage.completion_tokens // 2
    for lp in lps:   # greedy: the chosen token is the most likely one
        assert len(lp.top_logprobs) == 3 and lp.logprob <= 0
        assert abs(lp.top_logprobs[0].logprob - lp.logprob) < 1e-4
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob >= lp.top_logprobs[2].logprob
    assert "".join(lp.token for lp in lps) == r.choices[0].message.content


def _strict_json(text: str):
    """json.loads that refuses NaN/Infinity, as every JSON parser but Python's does."""
    def no_constant(name):
        raise ValueError(f"non-finite number {name} in JSON")
    return json.loads(text, parse_constant=no_constant)


@pytest.mark.parametrize("stream", [False, True])
def test_constrained_logprobs_are_finite_json(server, stream):
    """Logprobs of a constrained request are the model's own (vLLM's raw_logprobs):
    finite, so the body is JSON; they used to hold -inf for masked tokens (a 400
    after generating, or `-Infinity` in the stream)."""
    body = _chat(max_tokens=8, temperature=0, logprobs=True, top_logprobs=5, stream=stream,
                 structured_outputs={"choice": ["yes", "no"]})
    r = _post(server, body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [_strict_json(x[6:]) for x in r.text.splitlines()
                  if x.startswith("data: ") and x != "data: [DONE]"]
        entries = [e for c in chunks for ch in c["choices"]
                   for e in ((ch.get("logprobs") or {}).get("content") or [])]
        text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    else:
        choice = _strict_json(r.text)["choices"][0]
        entries, text = choice["logprobs"]["content"], choice["message"]["content"]
    assert text in ("yes", "no") and entries
    for e in entries:
        assert len(e["top_logprobs"]) == 5 and all(t["logprob"] <= 0 for t in e["top_logprobs"])


def test_return_token_ids_completions(server, tokenizer):
    """Per choice (each has its own prompt): the prompt's ids and the output's; streamed,
    the prompt's ids in each choice's first chunk and the new ids per chunk."""
    prompts = ["The capital of France is", "One, two,"]
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompts, "temperature": 0, "max_tokens": 6,
            "return_token_ids": True}
    whole = _post(server, body, path="/v1/completions").json()
    for c in whole["choices"]:
        assert c["prompt_token_ids"] == tokenizer(prompts[c["index"]]).input_ids
        assert c["text"] == tokenizer.decode(c["token_ids"], skip_special_tokens=True)
    events = [json.loads(line[6:]) for line in _post(server, {**body, "stream": True},
              path="/v1/completions").text.splitlines() if line.startswith("data: {")]
    for c in whole["choices"]:
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == c["index"]]
        assert mine[0]["prompt_token_ids"] == c["prompt_token_ids"]
        assert all("prompt_token_ids" not in m for m in mine[1:])
        assert [t for m in mine for t in m["token_ids"]] == c["token_ids"]
    plain = _post(server, {**body, "return_token_ids": False}, path="/v1/completions").json()
    assert "token_ids" not in plain["choices"][0]


def test_completions_endpoint(client, model):
    r = client.completions.create(model=model, prompt=["The capital of France is", "1, 2, 3,"],
                                  temperature=0, max_tokens=6, logprobs=2)
    assert [c.index for c in r.choices] == [0, 1] and r.object == "text_completion"
    assert "Paris" in r.choices[0].text and r.choices[1].text.startswith(" 4")
    assert r.choices[0].logprobs.tokens and len(r.choices[0].logprobs.top_logprobs[0]) == 2
    s = list(client.completions.create(model=model, prompt="The capital of France is",
                                       temperature=0, max_tokens=6, stream=True))
    assert "".join(c.choices[0].text for c in s if c.choices) == r.choices[0].text


# ---- constrained outputs ----------------------------------------------------------------

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3}},
    "required": ["name", "age", "pets"], "additionalProperties": False}
PROMPTS = ["Describe Alice, 30, who has a cat, as JSON.", "Give me a JSON person named Bob.",
           "Create a JSON profile for a pet owner."]


def _stops(results) -> list:
    stops = [r for r in results if r.choices[0].finish_reason == "stop"]
    assert stops, "no output finished with 'stop'; the check would be vacuous"
    return stops


def test_json_schema_outputs_validate(client, model):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    results = [client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=80,
        response_format=rf) for p in PROMPTS]
    for r in _stops(results):
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Car(BaseModel):
    brand: str = Field(max_length=16)
    year: int = Field(ge=1900, le=2030)
    color: Color


def test_parse_with_pydantic_model(client, model):
    r = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe a red 2010 Toyota car."}],
        temperature=0, max_tokens=60, response_format=Car)
    car = r.choices[0].message.parsed
    assert isinstance(car, Car) and 1900 <= car.year <= 2030 and len(car.brand) <= 16


def test_json_object(client, model):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Reply with a JSON object with a key 'ok'."}],
        temperature=0, max_tokens=40, response_format={"type": "json_object"})
    for s in _stops([r]):
        assert isinstance(json.loads(s.choices[0].message.content), dict)


def test_structural_tag_response_format(client, model):
    """vLLM's response_format type "structural_tag" (xgrammar's format object): the
    tagged segment is forced and its JSON validates; the older structures/triggers
    spelling and a missing body are told apart."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    fmt = {"type": "triggered_tags", "triggers": ["<f"], "at_least_one": True,
           "stop_after_first": True, "tags": [{"begin": "<f>", "end": "</f>", "content": {
               "type": "json_schema", "json_schema": schema}}]}
    ask = [{"role": "user", "content": "Call f with a=3 as <f>{json}</f>."}]
    for stream in (False, True):
        r = client.chat.completions.create(
            model=model, messages=ask, temperature=0, max_tokens=60, stream=stream,
            response_format={"type": "structural_tag", "format": fmt})
        text = "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream \
            else r.choices[0].message.content
        found = re.search(r"<f>(.*?)</f>", text, re.S)
        assert found, text
        jsonschema.validate(json.loads(found.group(1)), schema)
    legacy = {"type": "structural_tag", "triggers": ["<f"],
              "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}]}
    r = client.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=30,
                                       response_format=legacy)
    for segment in re.findall(r"<f>(.*?)</f>", r.choices[0].message.content, re.S):
        jsonschema.validate(json.loads(segment), schema)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ask, max_tokens=5,
                                       response_format={"type": "structural_tag"})
    assert e.value.body["param"] == "response_format"


def test_regex_choice_grammar_via_extra_body(client, model):
    ask = [{"role": "user", "content": "Name a city and its population in thousands."}]
    regex = r"[A-Z][a-z]{2,9}, [0-9]{1,4}"
    r = client.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=20,
                                       extra_body={"structured_outputs": {"regex": regex}})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(regex, r.choices[0].message.content)
    choices = ["positive", "negative", "neutral"]
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}],
        temperature=0, max_tokens=10, extra_body={"structured_outputs": {"choice": choices}})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content in choices
    grammar = 'root ::= ("yes" | "no") " because " [a-z ]{1,20} "."'
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Is the sky blue?"}], temperature=0,
        max_tokens=30, extra_body={"structured_outputs": {"grammar": grammar}})
    if r.choices[0].finish_reason == "stop":
        assert re.fullmatch(r"(yes|no) because [a-z ]{1,20}\.", r.choices[0].message.content)
    c = client.completions.create(model=model, prompt="My favourite number is", max_tokens=8,
                                  temperature=0, extra_body={"structured_outputs": {"regex": " [0-9]{2}"}})
    assert c.choices[0].finish_reason == "stop" and re.fullmatch(" [0-9]{2}", c.choices[0].text)


@pytest.mark.parametrize("backend", ["outlines", "llguidance", "guidance"])
def test_every_backend_serves_under_formwork_serve(client, model, backend):
    """The outlines backend compiles in a child process: the engine process must
    be allowed children (it was daemonic: "daemonic processes are not allowed to
    have children" on every outlines request under serve)."""
    regex = r"[A-Z][a-z]{2,9}, [0-9]{1,4}"
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a city and its population."}],
        temperature=0, max_tokens=20,
        extra_body={"structured_outputs": {"regex": regex, "backend": backend}})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(regex, r.choices[0].message.content)


# ---- tools ----------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris in celsius?"}]


def _check_calls(choice) -> list:
    calls = choice.message.tool_calls or []
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    return calls


def test_tool_choice_required_and_named(client, model):
    r = client.chat.completions.create(model=model, messages=WEATHER_Q, tools=TOOLS,
                                       tool_choice="required", temperature=0, max_tokens=80)
    c = r.choices[0]
    assert c.finish_reason in ("tool_calls", "length")
    if c.finish_reason == "tool_calls":
        assert _check_calls(c) and c.message.content is None
    r = client.chat.completions.create(
        model=model, messages=WEATHER_Q, tools=TOOLS, temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert [t.function.name for t in _check_calls(c)] == ["get_time"]
    single = client.chat.completions.create(
        model=model, messages=WEATHER_Q, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=60)
    if single.choices[0].finish_reason == "tool_calls":
        assert len(_check_calls(single.choices[0])) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_a_stop_string_is_not_finished_as_tool_calls(client, model, stream):
    """A named call's arguments cut by a stop string: finish_reason "stop" (with the
    stop string named), never "tool_calls", which says the calls are complete."""
    kw = dict(model=model, messages=WEATHER_Q, tools=TOOLS, temperature=0, max_tokens=40,
              tool_choice={"type": "function", "function": {"name": "get_time"}}, stop=['"'])
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        assert (c.finish_reason, c.model_extra.get("stop_reason")) == ("stop", '"')
        args = c.message.tool_calls[0].function.arguments
    else:
        finish, args, reasons = None, "", []
        for chunk in client.chat.completions.create(**kw, stream=True):
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
                reasons += [ch.model_extra["stop_reason"]] if "stop_reason" in ch.model_extra \
                    else []
                for tc in ch.delta.tool_calls or []:
                    args += tc.function.arguments or ""
        # the stop string is named on the finish chunk, as vLLM streams it
        assert finish == "stop" and reasons == ['"']
    with pytest.raises(json.JSONDecodeError):
        json.loads(args)                                  # the arguments were cut short


# The tiny model copies text well: asked to repeat a call with an invalid unit, the
# structural tag (active after "<tool_call>") must force a valid one.
CALL_Q = [{"role": "user", "content": 'Repeat exactly: <tool_call>\n{"name": "get_weather", '
           '"arguments": {"city": "Paris", "unit": "kelvin"}}\n</tool_call>'}]


def test_tool_choice_auto_keeps_a_set_argument_unique(client, model):
    """A tool with a set-typed argument (`uniqueItems`, pydantic's set[str]) under the
    default tool_choice "auto": served (it was a 400), and a call the model copies
    with a repeated item comes back without the repeat."""
    label = [{"type": "function", "function": {"name": "label", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                  "uniqueItems": True}},
        "required": ["tags"]}}}]
    ask = [{"role": "user", "content": 'Repeat exactly: <tool_call>\n{"name": "label", '
            '"arguments": {"tags": ["news", "news", "news"]}}\n</tool_call>'}]
    r = client.chat.completions.create(model=model, messages=ask, tools=label, temperature=0,
                                       max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason in ("tool_calls", "length"), c
    for call in c.message.tool_calls or []:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, label[0]["function"]["parameters"])
    if c.finish_reason == "tool_calls":
        assert json.loads(c.message.tool_calls[0].function.arguments)["tags"][0] == "news"


def test_tools_with_a_pattern_beside_a_response_format_are_served(client, model):
    """An agent with tools and an output type (openai-agents' shape): a tool schema
    with a `pattern` next to a json_schema response_format was a 400 (xgrammar
    refuses the pattern); now llguidance serves it and the answer validates."""
    code = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]+$"}},
        "required": ["code"], "additionalProperties": False}}}]
    answer = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=code, temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": answer}})
    c = r.choices[0]
    assert c.finish_reason in ("stop", "tool_calls", "length"), c
    if c.finish_reason == "stop":
        jsonschema.validate(json.loads(c.message.content), answer)
    for call in c.message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), code[0]["function"]["parameters"])


def test_tool_choice_auto(client, model):
    r = client.chat.completions.create(model=model, messages=CALL_Q, tools=TOOLS,
                                       temperature=0, max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    calls = _check_calls(c)
    assert [t.function.name for t in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments)["unit"] in ("celsius", "fahrenheit")
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                       temperature=0, max_tokens=24)
    c = r.choices[0]
    calls = _check_calls(c)
    assert "<tool_call>" not in (c.message.content or "")   # a call is parsed, never left as text
    assert (c.finish_reason == "tool_calls") == bool(calls)
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=16)
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content


def test_tool_calls_under_auto_and_json_objects_close_at_max_tokens(client, model):
    """Budget-aware decoding covers tool_choice "auto" and json_object: a call the
    model begins with too few tokens left for it as written (it writes this one in
    38) comes back parsed and valid (finish "length": closed early), or is never begun
    where it cannot close or only with placeholders (`"city": ""`); its raw
    `<tool_call>` text used to come back as `content`. A json_object output cut at
    max_tokens parses."""
    for max_tokens in (30, 36, 37):
        r = client.chat.completions.create(model=model, messages=CALL_Q, tools=TOOLS,
                                           temperature=0, max_tokens=max_tokens)
        c = r.choices[0]
        assert "<tool_call>" not in (c.message.content or ""), (max_tokens, c)
        if max_tokens == 37:
            calls = _check_calls(c)
            assert c.finish_reason == "length" and calls
            assert json.loads(calls[0].function.arguments)["city"]
    for max_tokens in (12, 24):
        r = client.chat.completions.create(
            model=model, messages=ASK, temperature=0.8, seed=1, max_tokens=max_tokens,
            response_format={"type": "json_object"})
        assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("auto", [False, True])
def test_streamed_tool_calls_equal_non_streamed(client, model, auto):
    kw = dict(model=model, messages=WEATHER_Q, tools=TOOLS, temperature=0, max_tokens=40,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if auto:
        kw.update(messages=CALL_Q, tool_choice="auto", max_tokens=60)
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                e = calls.setdefault(d.index, {"id": d.id, "name": "", "args": ""})
                e["name"] += d.function.name or ""
                e["args"] += d.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    # the same text, not only the same JSON (a named call's arguments stream as written)
    assert [(e["name"], e["args"]) for e in calls.values()] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert all(json.loads(e["args"]) is not None for e in calls.values())
    assert calls[0]["id"].startswith("call_")


def test_allowed_tools_narrow_the_calls_not_the_prompt(client, model, server):
    """OpenAI's tool_choice `allowed_tools`: calls only to the subset (mode "required"
    forces one), while the prompt lists every tool, as the same request with
    tool_choice "required" does (a stable prompt prefix); /v1/responses alike."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    allowed = {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}
    r = client.chat.completions.create(model=model, messages=ask, tools=TOOLS,
                                       tool_choice=allowed, temperature=0, max_tokens=40)
    calls = _check_calls(r.choices[0])
    assert calls and {c.function.name for c in calls} == {"get_time"}
    every = client.chat.completions.create(model=model, messages=ask, tools=TOOLS,
                                           tool_choice="required", max_tokens=1)
    assert r.usage.prompt_tokens == every.usage.prompt_tokens
    auto = {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}
    r = client.chat.completions.create(model=model, messages=CALL_Q, tools=TOOLS,
                                       tool_choice=auto, temperature=0, max_tokens=60)
    assert {c.function.name for c in _check_calls(r.choices[0])} <= {"get_weather"}
    bad = {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "nope"}}]}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ask, tools=TOOLS, tool_choice=bad,
                                       max_tokens=2)
    assert e.value.body["param"] == "tool_choice.allowed_tools.tools"
    resp = _post(server, {"model": "SmolLM2-135M-Instruct", "input": "Weather in Paris?",
                          "max_output_tokens": 40, "temperature": 0,
                          "tools": [{"type": "function", **t["function"]} for t in TOOLS],
                          "tool_choice": {"type": "allowed_tools", "mode": "required",
                                          "tools": [{"type": "function", "name": "get_time"}]}},
                 path="/v1/responses").json()
    names = [o["name"] for o in resp["output"] if o["type"] == "function_call"]
    assert names and set(names) == {"get_time"}, resp


def test_deprecated_functions_api(client, model):
    """OpenAI's deprecated `functions` / `function_call` (older clients still send
    them): served as tools with one call at most; the answer's `function_call` and
    finish_reason "function_call", streamed as `delta.function_call` pieces; the call
    and its result go back as an assistant `function_call` and a `function` message."""
    fn = {"name": "get_weather", "description": "Weather of a city",
          "parameters": PARAMS["get_weather"]}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=model, messages=ask, functions=[fn], function_call={"name": "get_weather"},
              temperature=0, max_tokens=40)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "function_call" and not whole.message.tool_calls
    call = whole.message.function_call
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), PARAMS["get_weather"])
    name, args, finish = "", "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            assert not ch.delta.tool_calls
            if ch.delta.function_call:
                name += ch.delta.function_call.name or ""
                args += ch.delta.function_call.arguments or ""
            finish = ch.finish_reason or finish
    assert (name, args, finish) == (call.name, call.arguments, "function_call")
    # the call and its result sent back: a plain answer under function_call "none"
    turn = ask + [{"role": "assistant", "content": None, "function_call": call.model_dump()},
                  {"role": "function", "name": "get_weather", "content": "sunny, 21 C"}]
    after = client.chat.completions.create(model=model, messages=turn, functions=[fn],
                                           function_call="none", max_tokens=8).choices[0]
    assert after.message.content and after.message.function_call is None
    for extra, param in (({"tools": TOOLS}, "functions"),
                         ({"function_call": {"name": "nope"}}, "function_call")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{**kw, **extra})
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ask, function_call="auto",
                                       max_tokens=2)
    assert e.value.body["param"] == "function_call"


# ---- errors -------------------------------------------------------------------------------

def _post(server, body, key=KEY, path="/v1/chat/completions", **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, bytes):
        headers["Content-Type"] = "application/json"
    return httpx.post(f"{server.url}{path}", headers=headers, timeout=60, **kw,
                      **({"content": body} if isinstance(body, bytes) else {"json": body}))


def _chat(**kw) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "messages": ASK, "max_tokens": 4, **kw}


ERROR_CASES = [  # (body, status, param, code, words that must appear in the message)
    (b'{"messages": [', 400, None, "invalid_json", ["JSON"]),
    # vLLM fields formwork does not serve: refused by name, never silently ignored
    (_chat(use_beam_search=True, n=11), 400, "n", None, ["[1, 10]"]),
    (_chat(use_beam_search=True, stream=True), 400, "stream", None, ["use_beam_search"]),
    (_chat(use_beam_search=True, logprobs=True), 400, "logprobs", None, ["use_beam_search"]),
    (_chat(use_beam_search=True, response_format={"type": "json_object"}), 400,
     "response_format", None, ["use_beam_search"]),
    (_chat(bad_words=["x"] * 300), 400, "bad_words", None, ["256"]),
    (_chat(bad_words=["  "]), 400, "bad_words", None, ["not only spaces"]),
    (_chat(allowed_token_ids=[]), 400, "allowed_token_ids", None, ["at least one"]),
    (_chat(allowed_token_ids=[5, 1000000]), 400, "allowed_token_ids", None,
     ["1000000", "vocabulary"]),
    (_chat(allowed_token_ids=[5, 6], logit_bias={"5": -100, "6": -100}), 400,
     "allowed_token_ids", None, ["logit_bias bans every token"]),
    (_chat(echo=True), 400, "echo", None, ["/v1/completions"]),
    (_chat(logprob_token_ids=[5]), 400, "logprob_token_ids", None, ["top_logprobs"]),
    (_chat(modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}), 400,
     "audio", None, ["text only"]),
    (_chat(modalities=["audio"]), 400, "modalities", None, ["text"]),
    (_chat(web_search_options={"search_context_size": "low"}), 400, "web_search_options",
     None, ["not served"]),
    (_chat(repetition_detection={"min_pattern_len": 2}), 400, "repetition_detection", None,
     ["not served"]),
    (_chat(thinking_token_budget=10), 400, "thinking_token_budget", None, ["not served"]),
    (_chat(watermarking=True), 400, "watermarking", None, ["not served"]),
    (_chat(truncation_side="middle"), 400, "truncation_side", None, ["left"]),
    (_chat(chat_template="{{ messages }}"), 400, "chat_template", None, ["template"]),
    (_chat(truncate_prompt_tokens=0), 400, "truncate_prompt_tokens", None, ["1024"]),
    (_chat(truncate_prompt_tokens=5000), 400, "truncate_prompt_tokens", None, ["1024"]),
    (_chat(cache_salt=""), 400, "cache_salt", None, ["non-empty"]),
    (_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}),
     400, "response_format", None, ["strin", "properties"]),
    (_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}}}}}),
     400, "response_format", None, ["minLength"]),
    (_chat(structured_outputs={"regex": "[a-"}), 400, "structured_outputs", None, ["regex"]),
    (_chat(structured_outputs={"grammar": "root ::= missing_rule"}), 400, "structured_outputs",
     None, ["grammar"]),
    (_chat(max_tokens=1020), 400, "messages", "context_length_exceeded", ["1024"]),
    (_chat(temperature=-1), 400, "temperature", None, [">= 0"]),
    (_chat(top_p=1.5), 400, "top_p", None, ["(0, 1]"]),
    (_chat(max_completion_tokens=0), 400, "max_completion_tokens", None, [">= 1"]),
    (_chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     400, "tool_choice", None, ["nope"]),
    (_chat(model="gpt-4o"), 404, "model", "model_not_found", ["gpt-4o"]),
    # values that reached a tensor or an int64 unchecked (issue 13: 500s or a whole batch failed)
    (_chat(stop_token_ids=[1000000], min_tokens=2), 400, "stop_token_ids", None,
     ["1000000"]),                                 # refused before queueing (issue 14)
    # issue 14: fields once ignored are refused naming the field
    (_chat(logit_bias={"1000000": 5}), 400, "logit_bias", None, ["1000000", "vocabulary"]),
    # vLLM's priority: refused (not ignored) by a first-come-first-served server
    (_chat(priority=1), 400, "priority", None, ["--scheduling-policy priority"]),
    (_chat(priority=2**40), 400, "priority", None, ["2^31"]),
    (_chat(temperature=2.5), 400, "temperature", None, ["[0, 2]"]),
    (_chat(structured_outputs={"choice": ["a", "b"]}, min_tokens=5, max_tokens=8), 400, "min_tokens", None,
     ["choice"]),
    (_chat(structured_outputs={"json": {}, "bogus_option": 1}), 400,
     "structured_outputs.bogus_option", None, ["unknown"]),
    (_chat(stop_token_ids=[2**70]), 400, "stop_token_ids", None, ["token ids"]),
    (_chat(seed=2**63), 400, "seed", None, ["2^63"]),
    (_chat(seed=2**63 - 2, n=4), 400, "seed", None, ["2^63"]),
    (_chat(n=1000), 400, "n", None, ["128"]),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": NaN}',
     400, "temperature", None, ["finite"]),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, '
     b'"repetition_penalty": Infinity}', 400, "repetition_penalty", None, ["finite"]),
    (b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 4}', 400,
     "messages[0].content", None, ["surrogate"]),
]


def test_nulls_are_defaults(server):
    """Explicit nulls (generated clients send every field) answer as if left out."""
    r = _post(server, _chat(n=None, stream=None, logprobs=None, parallel_tool_calls=None,
                            ignore_eos=None, stop=None, temperature=None, seed=None,
                            modalities=["text"], audio=None, web_search_options=None))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    r = _post(server, {"model": "SmolLM2-135M-Instruct", "prompt": "x", "echo": None,
                       "best_of": None, "n": None, "max_tokens": 2}, path="/v1/completions")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, r.text


def test_oversized_requests_are_refused_fast_while_a_stream_flows(server):
    """A 20 MB body -> 413 before it is parsed; a 4 MB message (under the body
    limit) -> 400 context_length_exceeded without tokenizing it; a stream running
    meanwhile keeps flowing (the event loop was blocked ~30 s before)."""
    import threading

    gaps: list[float] = []

    def stream():
        body = _chat(max_tokens=60, ignore_eos=True, stream=True, temperature=0)
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as r:
            last = time.monotonic()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

    def errors_413() -> float:
        return sum(v for k, v in metrics(server).items()
                   if k.startswith("formwork_request_errors_total") and 'status="413"' in k)

    before = errors_413()
    t = threading.Thread(target=stream)
    t.start()
    huge = json.dumps(_chat(messages=[{"role": "user", "content": "x" * (20 << 20)}])).encode()
    t0 = time.monotonic()
    r = _post(server, huge)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    def chunks():                                   # no Content-Length: counted as it arrives
        yield huge[: 1 << 20]
        for i in range(1 << 20, len(huge), 1 << 20):
            yield huge[i:i + (1 << 20)]
    r = httpx.post(f"{server.url}/v1/chat/completions", content=chunks(), timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert errors_413() == before + 2          # middleware refusals are counted too
    big = _post(server, _chat(messages=[{"role": "user", "content": "word " * (800 << 10)}]))
    elapsed = time.monotonic() - t0
    assert big.status_code == 400, big.text
    assert big.json()["error"]["code"] == "context_length_exceeded"
    assert big.json()["error"]["param"] == "messages"
    t.join(120)
    assert len(gaps) > 10 and elapsed < 15, (elapsed, max(gaps))
    assert max(gaps[1:]) < 5.0, max(gaps[1:])


def test_cors_by_default_answers_any_origin(server):
    """vLLM's default --allowed-origins ["*"]: a browser page may call the API; the
    preflight is answered before the key check."""
    r = httpx.get(f"{server.url}/v1/models", timeout=30,
                  headers={"Authorization": f"Bearer {KEY}", "Origin": "https://any.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    pre = httpx.options(f"{server.url}/v1/chat/completions", timeout=30, headers={
        "Origin": "https://any.example", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, model, tokenizer):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens, on both endpoints; a
    prompt longer than the context is cut instead of refused."""
    text = "one two three four five six seven eight nine ten"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    r = client.completions.create(model=model, prompt=text, max_tokens=1, echo=True,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3
    assert r.choices[0].text.startswith(tokenizer.decode(ids[-3:]))
    r = client.completions.create(model=model, prompt="word " * 3000, max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 1000})
    assert r.usage.prompt_tokens == 1000
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=1,
                                       extra_body={"truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5
    # vLLM's truncation_side "right": the first k instead
    r = client.completions.create(model=model, prompt=text, max_tokens=1, echo=True,
                                  extra_body={"truncate_prompt_tokens": 3,
                                              "truncation_side": "right"})
    assert r.usage.prompt_tokens == 3
    assert r.choices[0].text.startswith(tokenizer.decode(ids[:3]))
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=1, extra_body={
        "truncate_prompt_tokens": 5, "truncation_side": "right", "return_token_ids": True,
        "thinking_token_budget": -1})          # -1 is vLLM's "unlimited": served
    full = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True)
    full = full if isinstance(full, list) else full["input_ids"]
    assert r.model_extra["prompt_token_ids"] == full[:5]


def test_cache_salt_isolates_prefix_cache_hits(client, model):
    """vLLM's cache_salt: a request reuses cached prompt blocks only of requests with
    the same salt (usage.prompt_tokens_details.cached_tokens)."""
    msgs = [{"role": "user", "content": f"{uuid.uuid4()} " + "tell me about the sea " * 12}]

    def cached(salt):
        extra = {} if salt is None else {"cache_salt": salt}
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=1,
                                           extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= 32          # the same salt: its blocks
    assert cached("tenant-b") == 0
    # unsalted: earlier unsalted requests of this module share the template's first block
    first = cached(None)
    assert cached(None) >= max(first + 16, 32)   # ... and this conversation's blocks now


def _named_ids(names: list[str]) -> list[int]:
    assert all(n.startswith("token_id:") for n in names), names
    return [int(n.removeprefix("token_id:")) for n in names]


def _contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i:i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def test_allowed_token_ids_and_tokens_named_by_id(client, model, tokenizer):
    """vLLM's allowed_token_ids and return_tokens_as_token_ids on both endpoints: every
    generated token is one of the allowed, logprobs name tokens "token_id:<id>" (their
    bytes and text offsets stay those of the text)."""
    eos = tokenizer.eos_token_id
    allowed = tokenizer(" yes no maybe", add_special_tokens=False).input_ids + [eos]
    extra = {"allowed_token_ids": allowed, "return_tokens_as_token_ids": True}
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=1.0,
                                       seed=5, logprobs=True, top_logprobs=2, extra_body=extra)
    content = r.choices[0].logprobs.content
    ids = _named_ids([t.token for t in content])
    assert set(ids) <= set(allowed) and len(ids) == r.usage.completion_tokens
    _named_ids([x.token for t in content for x in t.top_logprobs])
    assert [bytes(t.bytes).decode() for t in content] == [tokenizer.decode([i]) for i in ids]
    assert r.choices[0].message.content == tokenizer.decode([i for i in ids if i != eos])
    r = client.completions.create(model=model, prompt="Is the sea blue? Answer:", max_tokens=6,
                                  logprobs=1, echo=True, extra_body=extra)
    lp = r.choices[0].logprobs
    ids = _named_ids(lp.tokens)
    assert set(ids[-r.usage.completion_tokens:]) <= set(allowed)
    assert lp.text_offset == [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]
    free = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0,
                                          logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    assert not set(_named_ids([t.token for t in free.choices[0].logprobs.content])) <= set(allowed)


def test_bad_words_are_not_generated(client, model, tokenizer):
    """vLLM's bad_words: a word of the greedy answer, banned, no longer appears as the
    tokenizer writes it (alone or after a space)."""
    def answer(**extra):
        r = client.chat.completions.create(
            model=model, messages=ASK, max_tokens=16, temperature=0, logprobs=True,
            extra_body={"return_tokens_as_token_ids": True, **extra})
        return _named_ids([t.token for t in r.choices[0].logprobs.content])

    free = answer()
    seqs = {}
    for word in re.findall(r"[A-Za-z]{3,}", tokenizer.decode(free)):
        seqs = [tokenizer(t, add_special_tokens=False).input_ids for t in (word, " " + word)]
        if any(_contains(free, s) for s in seqs):
            break
    assert any(_contains(free, s) for s in seqs), tokenizer.decode(free)
    banned = answer(bad_words=[word])
    assert not any(_contains(banned, s) for s in seqs), (word, tokenizer.decode(banned))


@pytest.mark.parametrize("stream", [False, True])
def test_bans_against_a_schema_leave_the_output_valid(server, tokenizer, stream):
    """A logit_bias banning every token that opens a JSON object, beside a schema whose
    output must open with one: the grammar wins, the output validates."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    opens = {str(i): -100 for i in range(len(tokenizer))
             if tokenizer.decode([i]).lstrip().startswith("{")}
    body = _chat(max_tokens=40, logit_bias=opens, stream=stream, response_format={
        "type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}})
    r = _post(server, body)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        assert all("error" not in e for e in events), events
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    else:
        text = r.json()["choices"][0]["message"]["content"]
        finish = [r.json()["choices"][0]["finish_reason"]]
    assert finish == ["stop"], (finish, text)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("opened,tools", [("<think>", False), ("<think>The user", False),
                                          ("<think>", True)])
def test_reasoning_parser_splits_thinking_from_content(server, client, model, tokenizer, opened,
                                                       tools):
    """`--reasoning-parser qwen3` on a chat whose assistant turn opens a <think> (the
    prompt leaves it open, as thinking models' templates do): the thinking is in
    `reasoning` / `reasoning_content`, the rest in `content`, exactly as the parser
    splits the generated text (its token ids from the logprobs), streamed or not.
    Without an open <think> the parser leaves the output alone (every other test of
    this module)."""
    from formwork.gateway.reasoning import split_reasoning
    msgs = [{"role": "user", "content": "Say: <think>ok</think>Yes"},
            {"role": "assistant", "content": opened}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    body = dict(model=model, messages=msgs, max_tokens=24, temperature=0, logprobs=True,
                extra_body={**extra, "return_tokens_as_token_ids": True})
    if tools:     # tool_choice auto: the thinking is split off before calls are parsed
        body.update(tools=TOOLS, tool_choice="auto")
    ids = httpx.post(f"{server.url}/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": model, "messages": msgs, **extra,
                           **({"tools": TOOLS} if tools else {})}, timeout=30).json()["tokens"]
    prompt = tokenizer.decode(ids)
    assert prompt.rstrip().endswith(opened)

    def expected(token_names: list[str]):
        raw = tokenizer.decode(_named_ids(token_names), skip_special_tokens=True)
        split = split_reasoning("qwen3", prompt, raw)
        assert split[0] is not None, raw          # the open <think> makes it reasoning
        return split

    r = client.chat.completions.create(**body)
    m = r.choices[0].message
    names = [t.token for t in r.choices[0].logprobs.content]
    assert (m.reasoning, m.content) == expected(names)
    assert m.model_extra["reasoning_content"] == m.reasoning
    # usage counts the thinking's tokens: up to the first output prefix that closes it
    ids = _named_ids(names)
    closed = [k for k in range(1, len(ids) + 1)
              if "</think>" in tokenizer.decode(ids[:k], skip_special_tokens=True)]
    thinking = closed[0] if closed else len(ids)
    assert r.usage.completion_tokens_details.reasoning_tokens == thinking
    reasoning, content, names = [], [], []
    for chunk in client.chat.completions.create(stream=True, **body):
        for c in chunk.choices:
            reasoning.append(getattr(c.delta, "reasoning", None) or "")
            assert (getattr(c.delta, "reasoning_content", None) or "") == reasoning[-1]
            content.append(c.delta.content or "")
            names += [t.token for t in (c.logprobs.content if c.logprobs else None) or ()]
    assert ("".join(reasoning) or None, "".join(content) or None) == expected(names)
    if tools:
        return
    # vLLM's include_reasoning false: the same answer, without its thinking
    body["extra_body"] = {**body["extra_body"], "include_reasoning": False}
    hidden = client.chat.completions.create(**body).choices[0]
    want = expected([t.token for t in hidden.logprobs.content])[1]
    assert getattr(hidden.message, "reasoning", None) is None and hidden.message.content == want
    assert "reasoning_content" not in (hidden.message.model_extra or {})
    chunks = [c for chunk in client.chat.completions.create(stream=True, **body)
              for c in chunk.choices]
    assert not any(getattr(c.delta, "reasoning", None) for c in chunks)
    assert ("".join(c.delta.content or "" for c in chunks) or None) == want


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats(server, path):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's
    usage so far (tokens counted up to that chunk); plain include_usage only the last."""
    body = _chat(max_tokens=12, temperature=0, ignore_eos=True, stream=True,
                 stream_options={"include_usage": True, "continuous_usage_stats": True})
    if path == "/v1/completions":
        body = {k: v for k, v in body.items() if k != "messages"} | {"prompt": "Once upon"}
    chunks = [json.loads(x[6:]) for x in _post(server, body, path=path).text.split("\n\n")
              if x.startswith("data: {")]
    *parts, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12
    used = [c["usage"]["completion_tokens"] for c in parts]
    assert all(c["usage"]["prompt_tokens"] == final["usage"]["prompt_tokens"] for c in parts)
    assert used == sorted(used) and used[-1] == 12 and len(set(used)) > 3
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + n
               for c, n in zip(parts, used))
    body["stream_options"] = {"include_usage": True}
    plain = [json.loads(x[6:]) for x in _post(server, body, path=path).text.split("\n\n")
             if x.startswith("data: {")]
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 12


def test_beam_search_on_both_endpoints(client, model):
    """vLLM's use_beam_search: n beams, best first; width 1 is greedy decoding."""
    prompt = "Once upon a time"
    greedy = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    one = client.completions.create(model=model, prompt=prompt, max_tokens=6, n=1,
                                    extra_body={"use_beam_search": True})
    assert one.choices[0].text == greedy.choices[0].text
    three = client.completions.create(model=model, prompt=[prompt, "The sky is"], max_tokens=6,
                                      n=3, extra_body={"use_beam_search": True,
                                                       "length_penalty": 0.5})
    assert [c.index for c in three.choices] == list(range(6))
    for group in (three.choices[:3], three.choices[3:]):
        texts = [c.text for c in group]
        assert len(set(texts)) == 3 and all(texts)
        assert all(c.finish_reason in ("stop", "length") for c in group)
    assert three.usage.completion_tokens <= 6 * 6 and three.usage.prompt_tokens > 0
    chat = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, n=2,
                                          extra_body={"use_beam_search": True})
    assert len(chat.choices) == 2 and chat.choices[0].message.content
    assert chat.choices[0].message.content != chat.choices[1].message.content


def test_schema_true_is_any_json_and_keeps_the_engine(server):
    """`"schema": true` (any value, as `{}`) used to reach the engine as a bool its
    decoder refused: the engine died, and the request's replay killed the restarted
    one too. Each spelling is served now; the engine never restarts."""
    before = httpx.get(f"{server.url}/health", timeout=10).json()["engine_restarts"]
    for extra in ({"response_format": {"type": "json_schema",
                                       "json_schema": {"name": "any", "schema": True}}},
                  {"structured_outputs": {"json": True}}, {"guided_json": "true"}):
        r = _post(server, _chat(max_tokens=24, temperature=0, **extra))
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            json.loads(choice["message"]["content"])
    r = _post(server, _chat(structured_outputs={"json": {}, "max_whitespace": "2"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.max_whitespace"
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {
        "status": "ready", "engine_restarts": before}


LINE_BREAKERS = "a\u2028b\x85c\u2029d"   # not JSON's whitespace; str.splitlines() breaks at each


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_stream_events_stay_one_line_for_splitlines_readers(server, path):
    """An output holding U+2028, U+0085 or U+2029 (a model writes them; here a choice
    constraint does) was sent raw inside the event's JSON, and httpx's `iter_lines()`
    (so httpx-sse), which splits at them, cut the event in two: a client's
    json.loads failed mid-stream (found with a tool whose enum held "\u2028"). Each
    data line now parses alone and the text comes back whole."""
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0,
            "stream": True, "structured_outputs": {"choice": [LINE_BREAKERS]}}
    if path == "/v1/responses":
        body |= {"input": "Say it.", "max_output_tokens": body.pop("max_tokens")}
    elif path == "/v1/chat/completions":
        body["messages"] = ASK
    else:
        body["prompt"] = "Say it:"
    events = []
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))      # raised JSONDecodeError before
            else:
                assert line == "" or line.startswith(("event: ", "data: [DONE]")), line
    if path == "/v1/responses":
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    elif path == "/v1/chat/completions":
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    else:
        text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == LINE_BREAKERS


@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_ending_in_a_replacement_character_comes_back_whole(server, stream):
    """The detokenizer held back a trailing U+FFFD (it may be an unfinished character)
    and the end never flushed it: "ok\ufffd" came back "ok", and streamed too."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": ASK, "max_tokens": 8,
            "temperature": 0, "stream": stream, "structured_outputs": {"choice": ["ok\ufffd"]}}
    if not stream:
        r = _post(server, body)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok\ufffd"
        return
    text = ""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
    assert text == "ok\ufffd"


def test_json_lines_escape_what_splitlines_breaks_at():
    from formwork.gateway.json_lines import dumps_line
    value = {"k\u2028": [LINE_BREAKERS, "é\x1c\n"], "n": 1}
    line = dumps_line(value, separators=(",", ":"))
    assert line.splitlines() == [line] and json.loads(line) == value
    assert "é" in line                   # other non-ASCII text stays as it is


def test_an_int64_floor_range_no_longer_kills_the_server(server):
    """llguidance crashed (SIGSEGV) building an integer range of the lowest few
    hundred int64 values, in the gateway's synchronous schema check: the request
    took the whole server down. Now served (by xgrammar), the output in range."""
    low = -2 ** 63
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": low,
                                                     "maximum": low + 8}}, "required": ["n"]}
    r = _post(server, _chat(max_tokens=40, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ready"


@pytest.mark.parametrize("body,status,param,code,words", ERROR_CASES)
def test_error_responses(server, body, status, param, code, words):
    r = _post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["code"] == code, err
    for w in words:
        assert w.lower() in err["message"].lower(), err["message"]


def test_api_key_and_openai_client_errors(server, client, model):
    for key, words in ((None, "didn't provide"), ("wrong", "incorrect api key")):
        r = _post(server, _chat(), key=key)
        assert r.status_code == 401 and words in r.json()["error"]["message"].lower()
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200   # not behind the key
    url = f"{server.url}/v1/models"
    assert httpx.get(url, headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(url, headers={"Authorization": f"Basic {KEY}"}).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}x"}).status_code == 401
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, temperature=5.0, top_p=0)
    assert e.value.status_code == 400 and e.value.body["param"] in ("top_p", "temperature")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=ASK)
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---- engine state, metrics, concurrency -------------------------------------------------------

def _wait_idle(server, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(server)
        held = m["formwork_kv_cache_held_blocks"]
        if (m["formwork_num_requests_running"] == 0 and m["formwork_num_requests_waiting"] == 0
                and held == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_blocks(server, stream):
    idle = _wait_idle(server)
    assert idle["formwork_kv_cache_held_blocks"] == 0
    body = _chat(max_tokens=800, ignore_eos=True, stream=stream,
                 messages=[{"role": "user", "content": "Tell me a very long story."}])
    with httpx.Client(timeout=60) as http:
        if stream:
            with http.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {KEY}"}) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(8)]          # a few tokens arrived
                assert any(line.startswith("data: ") for line in got)
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{server.url}/v1/chat/completions", json=body, timeout=3,
                          headers={"Authorization": f"Bearer {KEY}"})
    after = _wait_idle(server)
    assert after["formwork_kv_cache_held_blocks"] == 0
    assert after["formwork_num_requests_running"] == 0
    assert finish_reason_total(after, "abort") == finish_reason_total(idle, "abort") + 1
    assert after["formwork_engine_steps_total"] - idle["formwork_engine_steps_total"] < 700


def test_metrics_counters_move(server, client, model):
    checks = metrics(server).get("formwork_grammar_deferred_checks_total", 0)
    client.chat.completions.create(  # a grammar compile of its own: no reliance on test order
        model=model, messages=ASK, max_tokens=4, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    before = metrics(server)
    # greedy: its first pick was made without the mask and checked (deferred masks)
    assert before["formwork_grammar_deferred_checks_total"] > checks
    assert "formwork_grammar_deferred_refused_total" in before
    assert "formwork_grammar_deferred_rescued_total" in before
    r = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=8)
    after = metrics(server)
    label = f'{{model_name="{model}"}}'
    assert after[f"formwork_prompt_tokens_total{label}"] \
        - before.get(f"formwork_prompt_tokens_total{label}", 0) == r.usage.prompt_tokens
    assert after[f"formwork_generation_tokens_total{label}"] \
        - before.get(f"formwork_generation_tokens_total{label}", 0) == r.usage.completion_tokens
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        key = f"formwork_{h}_count{label}"
        assert after[key] == before.get(key, 0) + 1
    reason = r.choices[0].finish_reason
    assert finish_reason_total(after, reason) == finish_reason_total(before, reason) + 1
    assert after["formwork_kv_cache_total_blocks"] > 0
    assert after["formwork_grammar_compiles_total"] >= 1      # the choice request above
    assert after["formwork_engine_steps_total"] > before["formwork_engine_steps_total"]


FOUR = {"type": "object", "properties": {k: {"type": "string"} for k in "abcd"},
        "required": list("abcd"), "additionalProperties": False}
WRITE = [{"role": "user", "content": "Write a long story as JSON fields a, b, c, d."}]


def test_constrained_outputs_say_whether_they_validate(server):
    """The `formwork` extension field: valid true for a complete output, false (why)
    for one max_tokens cut (budget-aware decoding off), on the last stream chunk
    too; counted in formwork_constrained_outputs_total; vLLM's metric names."""
    label = 'model_name="SmolLM2-135M-Instruct"'

    def total(m, result):
        return m.get(f'formwork_constrained_outputs_total{{{label},result="{result}"}}', 0)

    before = metrics(server)
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": FOUR}}
    cut = _post(server, _chat(messages=WRITE, max_tokens=12, response_format=rf,
                              structured_outputs={"budget_aware": False})).json()["choices"][0]
    assert cut["finish_reason"] == "length" and cut["formwork"]["valid"] is False
    assert cut["formwork"]["error"].startswith("cut by max_tokens")
    closed = _post(server, _chat(messages=WRITE, max_tokens=24, response_format=rf)).json()
    assert closed["choices"][0]["formwork"] == {"valid": True, "error": None}
    jsonschema.validate(json.loads(closed["choices"][0]["message"]["content"]), FOUR)
    plain = _post(server, _chat()).json()["choices"][0]
    assert "formwork" not in plain
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json=_chat(max_tokens=40, stream=True,
                                 structured_outputs={"choice": ["Paris", "Lyon"]})) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    finals = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f.get("formwork") for f in finals] == [{"valid": True, "error": None}]
    assert all("formwork" not in c["choices"][0] for c in chunks[:-1] if c["choices"]
               and not c["choices"][0]["finish_reason"])
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is",
            "max_tokens": 8, "structured_outputs": {"choice": [" Paris", " Lyon"]}}
    done = _post(server, body, path="/v1/completions").json()["choices"][0]
    assert done["formwork"] == {"valid": True, "error": None}
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}, json=body | {"stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [c["choices"][0].get("formwork") for c in chunks] == \
        [None] * (len(chunks) - 1) + [{"valid": True, "error": None}]
    after = metrics(server)
    assert total(after, "valid") == total(before, "valid") + 4
    assert total(after, "invalid") == total(before, "invalid") + 1
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert f"{name}{{{label}}}" in after, name
    assert after[f'vllm:request_success_total{{finished_reason="length",{label}}}'] >= 2


def test_64_concurrent_constrained_requests(server, model):
    """Each request's schema pins its own id, so a lost, duplicated or crossed output fails."""
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=600)

    def schema(i: int) -> dict:
        return {"type": "object", "properties": {
            "id": {"const": i}, "word": {"type": "string", "maxLength": 8},
            "ok": {"type": "boolean"}}, "required": ["id", "word", "ok"], "additionalProperties": False}

    async def one(i: int):
        return await aclient.chat.completions.create(
            model=model, temperature=0, max_tokens=32,
            messages=[{"role": "user", "content": f"Request {i}: give an id, a word and ok as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"r{i}", "schema": schema(i)}})

    async def run_all():
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(run_all())
    assert len({r.id for r in results}) == 64
    stops = 0
    for i, r in enumerate(results):
        c = r.choices[0]
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            stops += 1
            obj = json.loads(c.message.content)
            jsonschema.validate(obj, schema(i))
            assert obj["id"] == i
    assert stops >= 48, f"only {stops} of 64 finished"
    assert _wait_idle(server)["formwork_kv_cache_held_blocks"] == 0


def test_an_idle_keep_alive_connection_outlives_http_clients_pool_expiry(server):
    """httpx (the openai SDK's transport) keeps an idle connection for 5 s and then
    reuses it; a server that also closes idle connections at 5 s races it, and a
    POST sent as the server closes fails with a ReadError (bench/soak.py lost one
    that way). The server must keep an idle connection longer than the clients do."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        def get_version() -> bytes:
            s.sendall(b"GET /version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            data = b""
            while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                chunk = s.recv(4096)
                if not chunk:
                    return data
                data += chunk
            return data
        assert get_version().startswith(b"HTTP/1.1 200")
        time.sleep(7.0)                                  # past httpx's keepalive_expiry
        assert get_version().startswith(b"HTTP/1.1 200"), "the server closed an idle connection"


def test_a_backtracking_regex_does_not_freeze_the_server(server, model, tokenizer):
    """The output check runs on the event loop: a regex constraint `(a|aa)+b` whose
    output max_tokens cuts inside the a's (b-tokens banned) held it for 18 s at 40
    tokens with Python's re, and every other request waited. Now the check gives
    up at its timeout and says so; /health answers throughout."""
    ban = {str(i): -100 for t, i in tokenizer.get_vocab().items() if "b" in t}
    done = {}

    def evil():
        done["r"] = httpx.post(f"{server.url}/v1/completions", timeout=120,
                               headers={"Authorization": f"Bearer {KEY}"}, json={
            "model": model, "prompt": "aaaa", "max_tokens": 60, "temperature": 0,
            "structured_outputs": {"regex": "(a|aa)+b"}, "logit_bias": ban})
    thread = threading.Thread(target=evil)
    thread.start()
    slowest = 0.0
    while thread.is_alive():
        start = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.05)
    choice = done["r"].json()["choices"][0]
    assert choice["finish_reason"] == "length" and set(choice["text"]) == {"a"}
    assert choice["formwork"]["valid"] is None and "backtracking" in choice["formwork"]["error"]
    assert slowest < 10.0         # (re: the loop was held for the whole check, hours at 60 a's)


def test_zz_sigterm_leaves_no_orphan_engine(server):
    """Last in the module: stops the shared server."""
    pids = server.child_pids()
    rc = server.stop(signal.SIGTERM)
    # uvicorn re-raises the captured SIGTERM after its graceful shutdown
    assert rc in (0, -signal.SIGTERM), server.logs()
    assert "Application shutdown complete" in server.logs()
    for pid in pids:
        assert gone(pid), f"engine process {pid} outlived the server"


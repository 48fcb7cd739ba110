"""Random combinations of request fields against a real `formwork serve` (the tiny
random-weight model, so that every request finishes in milliseconds): sampling
fields, stop strings, min_tokens, logit_bias, allowed_token_ids, bad_words, logprobs
(also named by token id), n / best_of, echo,
truncation, cache salts, response formats, schemas, tools under every tool_choice,
regex / choice / grammar constraints, streamed and not. Whatever the mix: never a
5xx, an OpenAI-shaped error for a 400, a stream that ends with [DONE] and no error
event, a finish reason OpenAI knows, "tool_calls" only with complete calls, a
constrained output that finished "stop" (not by a stop string) validating against
its schema, streamed ones too, usage that adds up. Two bugs were found this way (min_tokens against a
grammar's end; a cut call finished as "tool_calls")."""
from __future__ import annotations

import json
import random

import httpx
import jsonschema
import pytest

from test_server import KEY, Server

pytestmark = pytest.mark.slow

REQUESTS = 120
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "n"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 1,
     "maxItems": 3},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {
        "type": "string", "maxLength": 5}, "uniqueItems": True, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                      "ok": {"type": "boolean"}}, "required": ["d", "ok"]},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 15}},
             "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"]}}}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # started with a vLLM-style command line (--model, no-op and mapped vLLM flags)
    s = Server("--model", str(tiny_model_dir), "--max-model-len", "512", "--max-num-seqs", "16",
               "--kv-cache-memory-gb", "0.1", "--dtype", "float32", "--served-model-name", "m",
               "--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--disable-log-requests", "--guided-decoding-backend", "auto")
    yield s
    s.stop()


def random_body(rng: random.Random) -> tuple[bool, dict]:
    chat = rng.random() < 0.75
    b: dict = {"model": "m", "max_tokens": rng.choice([1, 5, 20, 60])}
    if chat:
        b["messages"] = [{"role": "user", "content": rng.choice(
            ["hi", "Weather in Paris?", "Add 2 and 3", "x" * rng.randint(1, 300)])}]
    else:
        b["prompt"] = rng.choice(["Once upon", ["a", "b c"], [1, 2, 3], "The answer is"])
    for key, p, values in [("n", 0.3, [1, 2, 3]), ("temperature", 0.5, [0, 0.7, 1.5]),
                           ("seed", 0.3, [0, 7, 1000]), ("top_p", 0.3, [0.5, 1.0]),
                           ("top_k", 0.2, [-1, 5]), ("stop", 0.2, ["\n", [".", "}"], '"']),
                           ("min_tokens", 0.2, [0, 3]), ("ignore_eos", 0.15, [True]),
                           ("logit_bias", 0.15, [{"28": -100}]),
                           ("include_stop_str_in_output", 0.15, [True]),
                           ("truncate_prompt_tokens", 0.15, [-1, 3, 50]),
                           ("cache_salt", 0.15, ["s1", "s2"]), ("prompt_logprobs", 0.1, [0, 2]),
                           ("repetition_penalty", 0.2, [1.2]),
                           ("allowed_token_ids", 0.1, [[28, 29, 30, 2], [0, 1, 2, 3, 90]]),
                           ("bad_words", 0.1, [["the"], ["Paris", "{", "\""]]),
                           ("return_tokens_as_token_ids", 0.1, [True])]:
        if rng.random() < p:
            b[key] = rng.choice(values)
    if "min_tokens" in b:
        b["min_tokens"] = min(b["min_tokens"], b["max_tokens"])
    if chat:
        if rng.random() < 0.3:
            b["logprobs"], b["top_logprobs"] = True, rng.choice([0, 3])
        r = rng.random()
        if r < 0.3:
            b["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "s", "schema": rng.choice(SCHEMAS), "strict": rng.random() < 0.5}}
        elif r < 0.4:
            b["response_format"] = {"type": "json_object"}
        elif r < 0.6:
            b["tools"] = TOOLS
            b["tool_choice"] = rng.choice(["auto", "required", "none",
                                           {"type": "function", "function": {"name": "add"}}])
            if rng.random() < 0.3:
                b["parallel_tool_calls"] = False
        elif r < 0.65:
            b["structured_outputs"] = rng.choice([{"regex": "[a-z]{2,6}"}, {"choice": ["yes", "no"]},
                                                  {"grammar": 'root ::= "x" [0-9]+'}])
    else:
        if rng.random() < 0.3:
            b["logprobs"] = rng.choice([0, 2])
        if rng.random() < 0.2:
            b["echo"] = True
        if rng.random() < 0.2 and b.get("n", 1) <= 2:
            b["best_of"] = b.get("n", 1) + 1
        if rng.random() < 0.2:
            b["structured_outputs"] = {"json": rng.choice(SCHEMAS)}
    b["stream"] = rng.random() < 0.4
    return chat, b


def call(url: str, chat: bool, b: dict):
    path = url + ("/v1/chat/completions" if chat else "/v1/completions")
    headers = {"Authorization": f"Bearer {KEY}"}
    if not b["stream"]:
        r = httpx.post(path, json=b, headers=headers, timeout=120)
        return r.status_code, r.json()
    events = []
    with httpx.stream("POST", path, json=b, headers=headers, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append("DONE" if line == "data: [DONE]" else json.loads(line[6:]))
    return 200, events


def schema_of(b: dict):
    rf = b.get("response_format") or {}
    if rf.get("type") == "json_schema":
        return rf["json_schema"]["schema"]
    return (b.get("structured_outputs") or {}).get("json")


def check_choice(chat: bool, b: dict, ch: dict) -> None:
    finish = ch["finish_reason"]
    assert finish in ("stop", "length", "tool_calls"), finish
    if chat and finish == "tool_calls":
        for tc in ch["message"]["tool_calls"]:
            json.loads(tc["function"]["arguments"])          # complete calls only
    schema = schema_of(b)
    cut = ch.get("stop_reason") is not None or (not chat and b.get("echo"))
    if schema is not None and finish == "stop" and not cut:
        text = ch["message"]["content"] if chat else ch["text"]
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def check_streamed(chat: bool, b: dict, events: list[dict], finishes: list[dict],
                   where: str) -> None:
    """A streamed constrained choice that finished "stop" on its own (no stop string
    named on its finish chunk) validates once its pieces are put together."""
    schema = schema_of(b)
    if schema is None or (not chat and b.get("echo")):
        return
    texts: dict[int, str] = {}
    for e in events:
        for c in e.get("choices", []):
            piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    for c in finishes:
        if c["finish_reason"] == "stop" and c.get("stop_reason") is None:
            text = texts.get(c["index"], "")
            try:
                jsonschema.validate(json.loads(text), schema,
                                    format_checker=jsonschema.FormatChecker())
            except (ValueError, jsonschema.ValidationError) as e:
                raise AssertionError(f"{where}\nstreamed {text!r}") from e


def test_random_requests_get_sound_answers(server):
    rng = random.Random(20261206)
    statuses = []
    for i in range(REQUESTS):
        chat, b = random_body(rng)
        status, out = call(server.url, chat, b)
        statuses.append(status)
        where = f"request {i}: {json.dumps(b)[:600]}"
        assert status in (200, 400), (where, out)
        if status == 400:
            assert set(out["error"]) >= {"message", "type", "param"}, (where, out)
            continue
        if b["stream"]:
            assert out and out[-1] == "DONE", where
            assert not [e for e in out[:-1] if "error" in e], (where, out[-3:])
            finishes = [c for e in out[:-1] for c in e.get("choices", []) if c.get("finish_reason")]
            assert finishes, where
            for c in finishes:
                assert c["finish_reason"] in ("stop", "length", "tool_calls"), where
            check_streamed(chat, b, out[:-1], finishes, where)
            continue
        for ch in out["choices"]:
            try:
                check_choice(chat, b, ch)
            except Exception as e:
                raise AssertionError(f"{where}\n{json.dumps(ch)[:800]}") from e
        u = out["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], where
    assert statuses.count(200) > REQUESTS * 0.8
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200

"""Tool-call formats (`--tool-call-parser`, gateway/tools.py ToolFormat): Llama 3's
JSON calls beside Hermes' tags. The auto-mode constraint, the tools prompt and
history a template without tools gets, parsing whole and streamed (any split of
the text gives the whole parse), and walks under the constraint's mask whose
calls parse back and validate."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from formwork.gateway.chat import render_messages
from formwork.gateway.tool_parser import ToolStreamParser, parse_tool_output
from formwork.gateway.tools import (HERMES, LLAMA3_JSON, ToolMode, parameters_schema,
                                    resolve_tool_mode, tool_constraint)
from formwork.grammar.backend import allocate_bitmask, allowed_token_ids
from formwork.grammar.manager import build_backend
from formwork.grammar.vocab import TokenVocab
from formwork.schemas.openai import ChatCompletionRequest, ChatMessage, FunctionDefinition

WEATHER = FunctionDefinition(name="weather", parameters={
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"], "additionalProperties": False})
TIME = FunctionDefinition(name="time", parameters={"type": "object", "properties": {}})
SCHEMAS = {"weather": WEATHER.parameters, "time": TIME.parameters}


def _mode(fmt, parallel=True, kind="auto"):
    return ToolMode(kind, (WEATHER, TIME), None, parallel, fmt)


def test_resolve_keeps_the_servers_format():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                tools=[{"type": "function", "function": WEATHER.model_dump()}])
    assert resolve_tool_mode(req).format is HERMES
    assert resolve_tool_mode(req, LLAMA3_JSON).format is LLAMA3_JSON


def test_auto_constraint_uses_the_formats_trigger_and_call_shape():
    hermes = tool_constraint(_mode(HERMES)).structural_tag["format"]
    assert hermes["triggers"] == ["<tool_call>"]
    assert hermes["tags"][0]["begin"] == '<tool_call>\n{"name": "weather", "arguments": '
    assert hermes["tags"][0]["end"] == "}\n</tool_call>"
    llama = tool_constraint(_mode(LLAMA3_JSON, parallel=False)).structural_tag["format"]
    assert llama["triggers"] == ['{"name": '] and llama["stop_after_first"] is True
    assert [t["begin"] for t in llama["tags"]] == ['{"name": "weather", "parameters": ',
                                                   '{"name": "time", "parameters": ']
    assert llama["tags"][0]["end"] == "}"
    assert llama["tags"][0]["content"]["json_schema"] == WEATHER.parameters


LLAMA_TEXT = ('Let me check. {"name": "weather", "parameters": {"city": "Paris {x}", "days": 2}}; '
              '{"name": "time", "parameters": {}}')


def test_llama_calls_parse_out_of_the_text():
    content, calls = parse_tool_output(_mode(LLAMA3_JSON), LLAMA_TEXT)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("weather", {"city": "Paris {x}", "days": 2}), ("time", {})]
    # not parallel: the first call only; a JSON object that is no call stays text
    assert len(parse_tool_output(_mode(LLAMA3_JSON, parallel=False), LLAMA_TEXT)[1]) == 1
    text = 'Use {"name": 3} as you like.'
    assert parse_tool_output(_mode(LLAMA3_JSON), text) == (text, [])
    # a bare JSON call is text to the Hermes format
    bare = '{"name": "time", "parameters": {}}'
    assert parse_tool_output(_mode(HERMES), bare) == (bare, [])
    assert len(parse_tool_output(_mode(LLAMA3_JSON), bare)[1]) == 1


@pytest.mark.parametrize("fmt,text", [
    (LLAMA3_JSON, LLAMA_TEXT),
    (LLAMA3_JSON, 'No call here: {"name" is a word} and {"a": 1}.'),
    (LLAMA3_JSON, '{"name": "time", "parameters": {}}'),
    (LLAMA3_JSON, 'cut {"name": "weather", "parameters": {"city": "Pa'),
    (HERMES, 'Sure.\n<tool_call>\n{"name": "weather", "arguments": {"city": "a}b"}}\n</tool_call>'
             '\n<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'),
])
def test_streamed_parse_equals_the_whole_parse_for_any_split(fmt, text):
    mode = _mode(fmt)
    want_content, want_calls = parse_tool_output(mode, text)
    rng = random.Random(3)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(6, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        parser, content, calls = ToolStreamParser(mode), "", []
        for piece in pieces:
            c, d = parser.feed(piece)
            content, calls = content + (c or ""), calls + d
        c, d = parser.finish()
        content, calls = content + (c or ""), calls + d
        assert (content.strip() or None) == want_content, pieces
        assert [(d.function.name, d.function.arguments) for d in calls] == \
            [(c.function.name, c.function.arguments) for c in want_calls], pieces


def test_tools_prompt_and_history_speak_the_format():
    msgs = [ChatMessage(role="user", content="Weather and time?"),
            ChatMessage(role="assistant", content=None, tool_calls=[
                {"id": "1", "type": "function",
                 "function": {"name": "weather", "arguments": '{"city": "Rome"}'}},
                {"id": "2", "type": "function", "function": {"name": "time", "arguments": "{}"}}]),
            ChatMessage(role="tool", content="sunny", tool_call_id="1")]
    llama = render_messages(msgs, _mode(LLAMA3_JSON), native_tools=False)
    assert '{"name": <function-name>, "parameters": <args-json-object>}' in llama[0]["content"]
    assert "<tool_call>" not in llama[0]["content"]
    assert llama[2]["content"] == ('{"name": "weather", "parameters": {"city": "Rome"}}; '
                                   '{"name": "time", "parameters": {}}')
    # what the prompt teaches parses back
    assert len(parse_tool_output(_mode(LLAMA3_JSON), llama[2]["content"])[1]) == 2
    hermes = render_messages(msgs, _mode(HERMES), native_tools=False)
    assert "<tool_call></tool_call> XML tags" in hermes[0]["content"]
    assert hermes[2]["content"] == (
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>')


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return TokenVocab.from_tokenizer(tokenizer, len(tokenizer))


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("parallel", [True, False])
def test_walks_under_the_llama_constraint_parse_back_valid(tokenizer, vocab, backend_name,
                                                           parallel):
    """Random walks under the auto constraint, entering a call through its trigger:
    every finished output parses into calls whose arguments validate (one call at
    most when calls are not parallel), and nothing else looks like a call."""
    mode = _mode(LLAMA3_JSON, parallel)
    compiled = build_backend(backend_name, vocab, tokenizer).compile(tool_constraint(mode))
    size = len(tokenizer)
    rng, finished, seen = random.Random(5), 0, 0
    prefix = tokenizer.encode('Sure {"name": ', add_special_tokens=False)

    def text_of(ids):
        return b"".join(vocab.token_bytes[t] for t in ids).decode("utf-8", "replace")

    for _ in range(12):
        m = compiled.new_matcher()
        assert m.accept_tokens(prefix)
        out, bm = list(prefix), allocate_bitmask(1, size)
        for _ in range(80):
            m.fill_bitmask(bm, 0)
            allowed = allowed_token_ids(bm, 0, size)
            assert allowed, "dead end"
            if vocab.eos_token_id in allowed and rng.random() < 0.4:
                break
            # no special token but the end of sequence, in free text or in a call
            assert all(vocab.token_bytes[t] is not None for t in allowed
                       if t != vocab.eos_token_id), text_of(out)
            short = [t for t in allowed if len(vocab.token_bytes[t] or b"...") <= 2]
            t = rng.choice(short if short and rng.random() < 0.8 else allowed)
            if t == vocab.eos_token_id:
                break
            assert m.accept_tokens([t])
            out.append(t)
        else:
            continue
        finished += 1
        text = text_of(out)
        _, calls = parse_tool_output(mode, text)
        assert calls and (parallel or len(calls) == 1), text
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            seen += 1
    assert finished >= 4 and seen >= finished


@pytest.mark.parametrize("params", [None, {}, {"type": "object", "properties": {}},
                                    {"type": "object"}, {"type": "object", "required": [],
                                                         "properties": {}, "title": "NoArgs"}])
@pytest.mark.parametrize("backend_name", ["auto", "xgrammar", "llguidance"])
def test_a_function_without_parameters_takes_no_arguments(tokenizer, vocab, params,
                                                           backend_name):
    """No parameters, or an object declaring no property (OpenAI's, MCP's and an empty
    pydantic model's "no arguments"): the named constraint admits `{}` and no key. It
    used to be the open object, where SmolLM2 invented one."""
    fn = FunctionDefinition(name="now", parameters=params)
    mode = ToolMode("named", (fn,), "now")
    compiled = build_backend("llguidance" if backend_name == "auto" else backend_name, vocab,
                             tokenizer).compile(tool_constraint(mode))
    m, size = compiled.new_matcher(), len(tokenizer)
    bm = allocate_bitmask(1, size)
    assert m.accept_tokens(tokenizer.encode("{", add_special_tokens=False))
    m.fill_bitmask(bm, 0)
    texts = {vocab.token_bytes[t] for t in allowed_token_ids(bm, 0, size)
             if t != vocab.eos_token_id}
    assert texts and all(set(b.decode()) <= set(" \t\n\r}") for b in texts), sorted(texts)[:5]
    assert m.accept_tokens(tokenizer.encode("}", add_special_tokens=False))
    if backend_name != "auto":
        return
    # what a schema says about undeclared names, or requires, keeps its meaning
    for kept in ({"type": "object", "additionalProperties": {"type": "string"}},
                 {"type": "object", "properties": {}, "additionalProperties": True},
                 {"type": "object", "patternProperties": {"^x": {}}},
                 {"type": "object", "required": ["q"]},
                 {"type": "object", "properties": {"q": {"type": "string"}}},
                 {"type": "object", "$ref": "#/$defs/A", "$defs": {"A": {}}}):
        assert parameters_schema(FunctionDefinition(name="f", parameters=kept)) == kept


class CannedEngine:
    """Answers every request with `text` (one token per character), as the engine
    client does: what the server makes of a model's output, without a model."""

    def __init__(self, text: str) -> None:
        from formwork.schemas.config import EngineConfig
        self.text, self.config, self.seen = text, EngineConfig(), []

    async def generate(self, request_id, prompt, prompt_ids, params):
        from formwork.gateway.output_processor import CompletionOutput, RequestOutput
        self.seen.append((prompt, params))
        text = ""
        for i, ch in enumerate(self.text):
            text += ch
            last = i == len(self.text) - 1
            out = CompletionOutput(index=0, text=text, token_ids=list(range(i + 1)),
                                   finish_reason="stop" if last else None,
                                   delta_text=ch, delta_token_ids=[i])
            yield RequestOutput(request_id, prompt, prompt_ids, [out], finished=last)


@pytest.mark.parametrize("stream", [False, True])
def test_a_server_under_llama3_json_returns_its_calls(tokenizer, stream):
    """The server's parser (RequestOptions.tool_call_parser, `--tool-call-parser`)
    reaches the prompt, the constraint and the parse of chat completions."""
    from fastapi.testclient import TestClient

    from formwork.gateway.api_server import build_app
    from formwork.gateway.metrics import Metrics
    from formwork.gateway.serve_options import RequestOptions
    from formwork.gateway.serving import ServerState

    engine = CannedEngine('Checking. {"name": "weather", "parameters": {"city": "Rome"}}')
    app = build_app(engine.config, served_model_names=["m"])
    app.state.server = ServerState(engine=engine, tokenizer=tokenizer, served_model_names=("m",),
                                   max_model_len=2048, metrics=Metrics("m"),
                                   options=RequestOptions(tool_call_parser="llama3_json"))
    client = TestClient(app)
    body = {"messages": [{"role": "user", "content": "Weather in Rome?"}], "stream": stream,
            "tools": [{"type": "function", "function": WEATHER.model_dump()}]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    prompt, params = engine.seen[-1]
    assert '"parameters": <args-json-object>' in prompt
    assert params.structured_outputs.structural_tag["format"]["triggers"] == ['{"name": ']
    if stream:
        chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        content = "".join(d.get("content") or "" for d in deltas)
        calls = [t["function"] for d in deltas for t in d.get("tool_calls") or ()]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    else:
        choice = r.json()["choices"][0]
        content, finish = choice["message"]["content"], choice["finish_reason"]
        calls = [t["function"] for t in choice["message"]["tool_calls"]]
    assert content == "Checking." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("weather", {"city": "Rome"})]

"""Fast gateway tests without a model: protocol -> SamplingParams, tools prompt /
constraint / parsing, OpenAI error mapping."""
from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from formwork.gateway.errors import APIError, from_value_error, install_error_handlers
from formwork.gateway.params import (chat_logprobs, chat_max_tokens, context_max_tokens, sampling_params,
                            structured_from_request)
from formwork.gateway.tool_parser import ToolStreamParser, parse_tool_output
from formwork.gateway.tools import ToolMode, resolve_tool_mode, tool_constraint
from formwork.schemas.openai import ChatCompletionRequest, CompletionRequest

MSGS = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"model": "m", "messages": MSGS, **kw})


def params_of(req: ChatCompletionRequest, max_tokens: int = 8):
    structured, _ = structured_from_request(req)
    requested, name = chat_max_tokens(req)
    return sampling_params(req, max_tokens=max_tokens if requested is None else requested, logprobs=chat_logprobs(req),
                           structured=structured,
                           rename={"max_tokens": name, "logprobs": "top_logprobs"})


# ---- protocol -> SamplingParams ----------------------------------------------------

def test_sampling_fields_map_one_to_one():
    p = params_of(chat(temperature=0.3, top_p=0.9, top_k=5, min_p=0.1, seed=7, stop="END",
                       presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
                       n=2, max_tokens=40, max_completion_tokens=12, logprobs=True,
                       top_logprobs=3, unknown_field={"x": 1}))
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.3, 0.9, 5, 0.1, 7)
    assert p.stop == ["END"] and p.n == 2 and p.logprobs == 3
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert p.max_tokens == 12          # max_completion_tokens wins over the deprecated max_tokens
    assert params_of(chat(logprobs=True)).logprobs == 0
    assert params_of(chat()).logprobs is None and params_of(chat()).temperature == 1.0


@pytest.mark.parametrize("field,value,param", [
    ("temperature", -1, "temperature"), ("top_p", 0, "top_p"), ("min_p", 2, "min_p"),
    ("presence_penalty", 3, "presence_penalty"), ("n", 0, "n"),
    ("max_completion_tokens", 0, "max_completion_tokens"), ("max_tokens", -2, "max_tokens"),
    ("top_logprobs", 30, "top_logprobs"), ("repetition_penalty", 0, "repetition_penalty"),
])
def test_out_of_range_values_are_400_naming_the_field(field, value, param):
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    with pytest.raises(APIError) as e:
        params_of(chat(**{field: value}, **extra))
    assert e.value.status == 400 and e.value.param == param
    assert e.value.message.startswith(param)


def test_top_logprobs_needs_logprobs():
    with pytest.raises(APIError) as e:
        params_of(chat(top_logprobs=2))
    assert e.value.param == "top_logprobs"


@pytest.mark.parametrize("model,base", [
    (ChatCompletionRequest, {"messages": MSGS}), (CompletionRequest, {"prompt": "x"})])
def test_a_null_optional_field_takes_its_default(model, base):
    """OpenAI types most request fields nullable and generated clients send nulls:
    null is the field left out, also where formwork's type has no null (n, stream,
    logprobs, parallel_tool_calls, vLLM's booleans...); a required field stays refused."""
    unset = model._defaulted_not_nullable()
    assert {"n", "stream"} <= unset
    nulls = model(**base, **{f: None for f in unset})
    assert nulls.model_dump() == model(**base).model_dump()
    with pytest.raises(ValueError):
        model(**{k: None for k in base})


def test_response_format_kinds():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    s, src = structured_from_request(chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}))
    assert s.json == schema and src == "response_format"
    s, _ = structured_from_request(chat(response_format={"type": "json_object"}))
    assert s.json_object is True and s.kind() == "json_object"
    assert structured_from_request(chat(response_format={"type": "text"})) == (None, None)
    with pytest.raises(APIError) as e:
        structured_from_request(chat(response_format={"type": "json_schema"}))
    assert e.value.param == "response_format.json_schema"


def test_response_format_structural_tag_maps_to_vllms_constraint():
    fmt = {"type": "triggered_tags", "triggers": ["<f"], "tags": [
        {"begin": "<f>", "content": {"type": "json_schema", "json_schema": {"type": "object"}},
         "end": "</f>"}]}
    s, src = structured_from_request(chat(response_format={"type": "structural_tag",
                                                           "format": fmt}))
    assert src == "response_format" and s.structural_tag == {"type": "structural_tag",
                                                             "format": fmt}
    legacy = {"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}]}
    s, _ = structured_from_request(chat(response_format={"type": "structural_tag", **legacy}))
    assert s.structural_tag == {"type": "structural_tag", **legacy}
    s, _ = structured_from_request(CompletionRequest(prompt="x", response_format={
        "type": "structural_tag", "format": fmt}))
    assert s.structural_tag["format"] == fmt
    for rf in ({"type": "structural_tag"}, {"type": "structural_tag", "triggers": ["<f"]}):
        with pytest.raises(APIError) as e:
            structured_from_request(chat(response_format=rf))
        assert e.value.status == 400 and e.value.param == "response_format"
    # free text with tagged segments is not a final answer's format beside tools
    req = chat(response_format={"type": "structural_tag", "format": fmt}, tools=[WEATHER])
    with pytest.raises(APIError) as e:
        structured_from_request(req, resolve_tool_mode(req))
    assert e.value.param == "tools" and "only one output constraint" in e.value.message
    req = chat(response_format={"type": "structural_tag", "format": fmt}, tools=[WEATHER],
               tool_choice="none")
    s, src = structured_from_request(req, resolve_tool_mode(req))
    assert src == "response_format" and s.kind() == "structural_tag"


def test_structured_outputs_extension_and_aliases():
    s, src = structured_from_request(chat(structured_outputs={"regex": "[a-z]+"}))
    assert s.regex == "[a-z]+" and src == "structured_outputs"
    s, _ = structured_from_request(chat(structured_outputs={"choice": ["a", "b"]}))
    assert s.choice == ["a", "b"]
    s, _ = structured_from_request(chat(guided_json={"type": "string"}))
    assert s.json == {"type": "string"}
    s, _ = structured_from_request(CompletionRequest(prompt="x", guided_choice=["y", "n"]))
    assert s.choice == ["y", "n"]
    # a value of the wrong type is refused naming its field
    for so, param in (({"regex": 5}, "structured_outputs.regex"),
                      ({"choice": ["a", 2]}, "structured_outputs.choice[1]"),
                      ({"json": {}, "max_whitespace": "2"}, "structured_outputs.max_whitespace")):
        with pytest.raises(APIError) as e:
            structured_from_request(chat(structured_outputs=so))
        assert e.value.param == param and e.value.message.startswith(param + ": Expected")
    # the schema `true` accepts any value, as `{}` does (a dict on the engine's wire)
    for spelled in (True, "true"):
        s, _ = structured_from_request(chat(structured_outputs={"json": spelled}))
        assert s.spec() == {}
    s, _ = structured_from_request(chat(response_format={
        "type": "json_schema", "json_schema": {"name": "any", "schema": True}}))
    assert s.json == {} and s.spec() == {}
    with pytest.raises(APIError) as e:
        structured_from_request(chat(response_format={"type": "json_object"},
                                     structured_outputs={"regex": "a"}))
    assert e.value.param == "structured_outputs" and "only one" in e.value.message


def test_context_length():
    assert context_max_tokens(10, None, 100, "messages") == 90
    assert context_max_tokens(10, 90, 100, "messages") == 90
    for prompt, req in ((10, 91), (100, None), (150, 5)):
        with pytest.raises(APIError) as e:
            context_max_tokens(prompt, req, 100, "messages")
        assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
        assert "maximum context length is 100 tokens" in e.value.message


# ---- tools ---------------------------------------------------------------------------

def test_tool_mode_resolution_and_errors():
    assert resolve_tool_mode(chat()).kind == "none"
    assert resolve_tool_mode(chat(tools=[WEATHER])).kind == "auto"
    m = resolve_tool_mode(chat(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_time"}}))
    assert (m.kind, m.name) == ("named", "get_time")
    for bad in ({"tool_choice": {"type": "function", "function": {"name": "nope"}},
                 "tools": [WEATHER]},
                {"tool_choice": "required"},
                {"tools": [WEATHER, WEATHER]}):
        with pytest.raises(APIError) as e:
            resolve_tool_mode(chat(**bad))
        assert e.value.status == 400 and e.value.param in ("tool_choice", "tools")


def test_required_constraint_accepts_exactly_valid_calls():
    mode = resolve_tool_mode(chat(tools=[WEATHER, TIME], tool_choice="required"))
    schema = tool_constraint(mode).json
    ok = [{"name": "get_weather", "arguments": {"city": "Paris"}},
          {"name": "get_time", "arguments": {"tz": "UTC"}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {"tz": "UTC"}}],
                [{"name": "other", "arguments": {}}], ok[0]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_constraint(resolve_tool_mode(chat(
        tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))).json
    jsonschema.validate(ok[1], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, single)


def test_named_and_auto_constraints():
    named = tool_constraint(resolve_tool_mode(chat(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}})))
    assert named.json == WEATHER["function"]["parameters"]
    auto = tool_constraint(resolve_tool_mode(chat(tools=[WEATHER, TIME]))).structural_tag
    fmt = auto["format"]
    assert auto["type"] == "structural_tag" and fmt["triggers"] == ["<tool_call>"]
    assert [t["begin"] for t in fmt["tags"]] == [
        '<tool_call>\n{"name": "get_weather", "arguments": ',
        '<tool_call>\n{"name": "get_time", "arguments": ']
    assert all(t["end"] == "}\n</tool_call>" for t in fmt["tags"])
    assert [t["content"]["json_schema"] for t in fmt["tags"]] == [
        WEATHER["function"]["parameters"], TIME["function"]["parameters"]]
    assert fmt["stop_after_first"] is False
    assert tool_constraint(resolve_tool_mode(chat(tools=[WEATHER], tool_choice="none"))) is None


AUTO_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
             '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
             '</tool_call>')


def test_parse_auto_named_required():
    auto = resolve_tool_mode(chat(tools=[WEATHER, TIME]))
    content, calls = parse_tool_output(auto, AUTO_TEXT)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "CET"})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert parse_tool_output(auto, "just text <tool_call>{broken") == ("just text <tool_call>{broken", [])
    single = resolve_tool_mode(chat(tools=[WEATHER, TIME], parallel_tool_calls=False))
    assert len(parse_tool_output(single, AUTO_TEXT)[1]) == 1
    named = ToolMode("named", auto.tools, "get_weather")
    content, calls = parse_tool_output(named, '{"city": "Rome"}')
    assert content is None and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Rome"}
    req = ToolMode("required", auto.tools)
    _, calls = parse_tool_output(req, '[{"name": "get_time", "arguments": {"tz": "UTC"}}]')
    assert calls[0].function.name == "get_time"
    assert parse_tool_output(req, '[{"name": "get_ti') == ('[{"name": "get_ti', [])


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
@pytest.mark.parametrize("kind", ["auto", "named", "required", "none"])
def test_stream_parser_matches_whole_parse(kind, step):
    tools = resolve_tool_mode(chat(tools=[WEATHER, TIME])).tools
    mode = ToolMode(kind, tools, "get_weather" if kind == "named" else None)
    text = {"auto": AUTO_TEXT, "named": '{"city": "Rome"}', "none": "plain <tool text",
            "required": '[{"name": "get_time", "arguments": {"tz": "UTC"}}]'}[kind]
    parser, content, calls = ToolStreamParser(mode), "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    results = [parser.feed(p) for p in pieces] + [parser.finish()]
    for c, deltas in results:
        content += c or ""
        for d in deltas:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
            assert (d.id is not None) == (entry["name"] == (d.function.name or "") != "")
    want_content, want_calls = parse_tool_output(mode, text)
    assert (content or None) == want_content
    got = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    assert got == [(c.function.name, json.loads(c.function.arguments)) for c in want_calls]


# ---- errors ----------------------------------------------------------------------------

def test_value_error_maps_to_param():
    e = from_value_error(ValueError("top_p: must be in (0, 1], got 0"))
    assert (e.status, e.param, e.type) == (400, "top_p", "invalid_request_error")
    assert from_value_error(ValueError("something odd")).param is None


@pytest.fixture(scope="module")
def error_client():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def route(body: ChatCompletionRequest):
        if body.model == "missing":
            raise APIError(404, "no such model", param="model", code="model_not_found")
        params_of(body)
        return {"ok": True}

    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize("body,status,param,text", [
    (b"{not json", 400, None, "could not parse the JSON"),
    ({"model": "m"}, 400, "messages", "Field required"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", ""),
    # as OpenAI and vLLM: only an assistant message may leave its content out
    ({"model": "m", "messages": [{"role": "user"}]}, 400, "messages[0].content",
     "Field required for a user message"),
    ({"model": "m", "messages": MSGS + [{"role": "tool", "tool_call_id": "c1", "content": None}]},
     400, "messages[1].content", "Field required for a tool message"),
    ({"model": "m", "messages": MSGS, "temperature": "hot"}, 400, "temperature", ""),
    ({"model": "m", "messages": MSGS, "top_p": 5}, 400, "top_p", "must be in (0, 1]"),
    ({"model": "missing", "messages": MSGS}, 404, "model", "no such model"),
])
def test_error_json_shape(error_client, body, status, param, text):
    kw = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    r = error_client.post("/v1/chat/completions", **kw)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and text in err["message"]
    assert err["type"] == "invalid_request_error"
    ok = error_client.post("/v1/chat/completions", json={"model": "m", "messages": MSGS, "x": 1})
    assert ok.status_code == 200
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ok = error_client.post("/v1/chat/completions", json={"model": "m", "messages": MSGS + [
        {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1",
                                                       "content": ""}]})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path,extra,param,text", [
    # a value no member of the union takes: what the field takes, in words
    ("chat", {"stop": 5}, "stop", "stop: must be a string or a list of strings, got the number 5"),
    ("chat", {"tool_choice": "bogus"}, "tool_choice",
     "must be one of 'none', 'auto', 'required' or an object, got a string"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "must be a string or a list of objects"),
    ("completions", {"prompt": None}, "prompt",
     "must be a string, a list of strings, a list of integers or a list of lists of "
     "integers, got null"),
    # a value whose shape picked a member: that member's own error, where it is
    ("chat", {"stop": ["a", 5]}, "stop[1]", "valid string"),
    ("chat", {"tool_choice": {"type": "function"}}, "tool_choice.function", "Field required"),
    ("chat", {"tool_choice": {"type": "function", "function": {}}},
     "tool_choice.function.name", "Field required"),
    ("chat", {"tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]}}},
     "tool_choice.allowed_tools.mode", "'auto' or 'required'"),
    ("completions", {"prompt": [[1, "a"]]}, "prompt[0][1]", "valid integer"),
])
def test_union_fields_name_the_field_not_pydantics_member(path, extra, param, text):
    """pydantic tries each member of a union (`str | list[str]`) and puts the member
    into the error's location (`stop.str`, `tool_choice.literal[...]`): the client's
    field is named instead, with what it takes."""
    from formwork.schemas.openai import CompletionRequest

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        return {"ok": True}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return {"ok": True}

    base = {"model": "m", "messages": MSGS} if path == "chat" else {"model": "m", "prompt": "x"}
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    r = TestClient(app).post(url, json={**base, **extra})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"], err
    assert "more error" not in err["message"]     # the union's tries are one error


# ---- chat prompt ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(default_model_dir))


def _prompt(tokenizer, req: ChatCompletionRequest) -> str:
    from formwork.gateway.chat import build_chat_prompt
    prompt, ids = build_chat_prompt(tokenizer, req.messages, resolve_tool_mode(req))
    assert tokenizer.decode(ids) == prompt
    return prompt


def test_chatml_prompt_without_tools(tokenizer):
    from formwork.gateway.chat import template_supports_tools
    assert not template_supports_tools(tokenizer)
    want = tokenizer.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False)
    assert _prompt(tokenizer, chat()) == want
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    assert _prompt(tokenizer, chat(messages=parts)) == want
    assert _prompt(tokenizer, chat(tools=[WEATHER], tool_choice="none")) == want


def test_hermes_tools_prompt(tokenizer):
    p = _prompt(tokenizer, chat(tools=[WEATHER, TIME]))
    assert p.startswith("<|im_start|>system\n# Tools") and "SmolLM" not in p
    tools_block = p.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in tools_block] == ["get_weather", "get_time"]
    assert p.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    sys_first = [{"role": "developer", "content": "Be terse."}] + MSGS
    p = _prompt(tokenizer, chat(messages=sys_first, tools=[WEATHER]))
    assert p.startswith("<|im_start|>system\nBe terse.\n\n# Tools")
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    p = _prompt(tokenizer, chat(messages=history, tools=[WEATHER]))
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo"}}\n</tool_call><|im_end|>') in p
    assert "<|im_start|>tool\n<tool_response>\nsunny\n</tool_response><|im_end|>" in p


def test_native_tools_template_gets_tools_kwarg(tokenizer):
    from formwork.gateway.chat import build_chat_prompt

    class Native:
        chat_template = "{{ tools | length }} tools"
        seen = None

        def apply_chat_template(self, msgs, **kw):
            Native.seen = kw
            return f"{len(kw.get('tools', []))} tools"

        def encode(self, text, add_special_tokens):
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    req = chat(tools=[WEATHER, TIME])
    prompt, _ = build_chat_prompt(Native(), req.messages, resolve_tool_mode(req))
    assert prompt == "2 tools" and Native.seen["tools"][0]["function"]["name"] == "get_weather"


def test_non_text_content_is_400(tokenizer):
    img = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(APIError) as e:
        _prompt(tokenizer, chat(messages=img))
    assert e.value.param == "messages[0].content"


@pytest.mark.parametrize("content,headers,detail", [
    (b"", {"content-type": "application/json"}, "the body is empty"),
    (b'{"messages": [', {}, "valid dictionary"),            # no JSON content type
    (b'[1, 2]', {"content-type": "application/json"}, "valid dictionary"),
])
def test_whole_body_errors_are_invalid_json(error_client, content, headers, detail):
    r = error_client.post("/v1/chat/completions", content=content, headers=headers)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_json" and err["param"] is None
    assert detail in err["message"]


# ---- issue 13, point 10: the published OpenAPI document and the server agree -------------

@pytest.fixture(scope="module")
def app_client(tokenizer):
    """The real app's routes, middleware and handlers; no engine (its lifespan does not run)."""
    from formwork.gateway.api_server import build_app
    from formwork.gateway.metrics import Metrics
    from formwork.gateway.serving import ServerState
    from formwork.schemas.config import EngineConfig

    app = build_app(EngineConfig(), served_model_names=["m"])
    app.state.server = ServerState(engine=None, tokenizer=tokenizer, served_model_names=("m",),
                                   max_model_len=1024, metrics=Metrics("m"))
    return TestClient(app, raise_server_exceptions=False)


def _body_error(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_openapi_says_400_not_422(app_client):
    spec = app_client.get("/openapi.json").json()
    assert "422" not in json.dumps(spec["paths"])
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    for path, method in (("/v1/chat/completions", "post"), ("/v1/completions", "post"),
                         ("/detokenize", "post")):
        responses = spec["paths"][path][method]["responses"]
        assert responses["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    error = spec["components"]["schemas"]["ErrorResponse"]
    assert error["properties"]["error"] == {"$ref": "#/components/schemas/ErrorInfo"}
    assert _body_error(app_client.post("/v1/completions", json={}))["param"] == "prompt"


def test_openapi_operation_ids_are_unique(app_client):
    """OpenAPI requires each operationId once; /ping's GET and POST shared one (client
    generators and schemathesis read them as keys)."""
    spec = app_client.get("/openapi.json").json()
    ids = [op["operationId"] for item in spec["paths"].values() for op in item.values()
           if isinstance(op, dict) and "operationId" in op]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert {"get", "post"} <= set(spec["paths"]["/ping"])


def test_405_says_allow(app_client):
    r = app_client.post("/v1/models")
    assert _body_error(r, 405) and r.headers["Allow"] == "GET"
    assert app_client.get("/v1/chat/completions").headers["Allow"] == "POST"


@pytest.mark.parametrize("body,refused", [
    ({}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"),
    ({"prompt": [""]}, "prompt"), ({"prompt": [[]]}, "prompt"), ({"prompt": [-1]}, "prompt"),
    ({"prompt": "x", "best_of": 0}, "best_of"), ({"prompt": "x", "best_of": 129}, "best_of"),
    ({"prompt": "x", "n": 0}, "n"), ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": "x"}, None), ({"prompt": [1, 2]}, None), ({"prompt": "x", "best_of": 2}, None),
])
def test_completion_schema_declares_what_the_server_refuses(app_client, body, refused):
    """Each body the server refuses with a 400 naming a field (empty prompts, best_of 0)
    the published schema refuses too; the others it accepts."""
    spec = app_client.get("/openapi.json").json()
    schema = {"$ref": "#/components/schemas/CompletionRequest", "components": spec["components"]}
    assert jsonschema.Draft202012Validator(schema).is_valid(body) == (refused is None)
    if refused is not None:
        assert _body_error(app_client.post("/v1/completions", json=body))["param"] == refused


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": False}}, "structured_outputs.json"),
])
def test_false_schema_is_a_clear_400(app_client, extra, param):
    err = _body_error(app_client.post("/v1/chat/completions",
                                      json={"messages": MSGS, **extra}))
    assert err["param"] == param and "schema `false` accepts no value" in err["message"]
    assert "exactly one of" not in err["message"]


def _nested(depth: int, open_: str = "[", close: str = "]") -> bytes:
    return ('{"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"json": '
            + open_ * depth + "1" + close * depth + "}}").encode()


@pytest.mark.parametrize("content,words", [
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not valid UTF-8 (byte 0xe9"),
    (_nested(500), "nested more than 128 levels"),
    (_nested(500, '{"a": ', "}"), "nested more than 128 levels"),
    (_nested(100_000), "nested too deeply"),
])
def test_unreadable_bodies_are_invalid_json_naming_the_problem(app_client, content, words):
    r = app_client.post("/v1/chat/completions", content=content,
                        headers={"content-type": "application/json"})
    err = _body_error(r)
    assert err["code"] == "invalid_json" and err["param"] is None
    assert words in err["message"] and "error parsing the body" not in err["message"]


@pytest.mark.parametrize("kind", ["auto", "named", "required"])
def test_tool_arguments_keep_numbers_as_written(kind):
    """Arguments were parsed and dumped again: `1e999` came back as `Infinity`
    (not JSON; pydantic and JSON.parse refuse it) and `1.10` as `1.1`. Numbers
    are now passed as written; other values as before; a number is no name."""
    args = '{"n": 1e999, "p": 1.10, "i": -0, "big": 123456789012345678901234567890, ' \
           '"s": "x\\"y", "l": [1E5, true, null], "o": {}}'
    tools = resolve_tool_mode(chat(tools=[WEATHER, TIME])).tools
    mode = ToolMode(kind, tools, "get_weather" if kind == "named" else None)
    text = {"named": args,
            "auto": f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>',
            "required": f'[{{"name": "get_weather", "arguments": {args}}}]'}[kind]
    _, calls = parse_tool_output(mode, text)
    got = calls[0].function.arguments
    assert got == args
    assert json.loads(got)["s"] == 'x"y'
    if kind != "named":
        bad = text.replace('"name": "get_weather"', '"name": 5')
        assert parse_tool_output(mode, bad)[1] == []


@pytest.mark.parametrize("tool_choice", ["required", "auto", "named"])
@pytest.mark.parametrize("bad,keyword", [({"const": 1, "enum": [2]}, "const"),
                                         ({"enum": []}, "enum")])
def test_a_tool_schema_no_value_meets_is_named_where_it_is(tokenizer, tool_choice, bad, keyword):
    """The tools' combined constraint (a call list, a structural tag) was refused with
    a path into formwork's own wrapper (`minItems at $`, `$.format.tags[0]...`): the
    tool whose parameters fail alone is named, with the path inside its schema."""
    from types import SimpleNamespace

    from formwork.gateway.api_server import build_app
    from formwork.gateway.metrics import Metrics
    from formwork.gateway.serving import ServerState
    from formwork.schemas.config import EngineConfig

    app = build_app(EngineConfig(), served_model_names=["m"])
    app.state.server = ServerState(engine=SimpleNamespace(config=EngineConfig()),
                                   tokenizer=tokenizer, served_model_names=("m",),
                                   max_model_len=1024, metrics=Metrics("m"))
    ok = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    bad_tool = {"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"x": bad}, "required": ["x"]}}}
    # under "required" a call list is refused only when no tool can be called: beside
    # a good tool llguidance drops the branch no call can take ("bad" is never called)
    tools = [bad_tool] if tool_choice == "required" else \
        [{"type": "function", "function": {"name": "good", "parameters": ok}}, bad_tool]
    choice = {"type": "function", "function": {"name": "bad"}} if tool_choice == "named" \
        else tool_choice
    err = _body_error(TestClient(app, raise_server_exceptions=False).post(
        "/v1/chat/completions", json={"model": "m", "messages": MSGS, "tools": tools,
                                      "tool_choice": choice}))
    assert err["param"] == f"tools[{len(tools) - 1}].function.parameters", err
    assert f"keyword '{keyword}' at $.properties.x" in err["message"], err


def test_an_answer_schema_the_tool_constraint_cannot_carry_is_named_as_response_format(
        tokenizer):
    """Beside tools in auto mode the response_format's schema is served inside the
    tool-call constraint (a structural tag), where uniqueItems and a number's
    multipleOf are not enforced although each is alone: the refusal named `tools`
    and a path into formwork's wrapper ($.format.elements[0].json_schema...)."""
    from types import SimpleNamespace

    from formwork.gateway.api_server import build_app
    from formwork.gateway.metrics import Metrics
    from formwork.gateway.serving import ServerState
    from formwork.schemas.config import EngineConfig

    app = build_app(EngineConfig(), served_model_names=["m"])
    app.state.server = ServerState(engine=SimpleNamespace(config=EngineConfig()),
                                   tokenizer=tokenizer, served_model_names=("m",),
                                   max_model_len=1024, metrics=Metrics("m"))
    answer = {"type": "object", "properties": {
        "v": {"anyOf": [{"type": "number", "multipleOf": 0.5}, {"type": "boolean"}]},
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
        "required": ["v", "tags"], "additionalProperties": False}
    body = {"model": "m", "messages": MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": answer}}}
    from formwork.grammar.selection import choose_backend
    from formwork.schemas.structured import StructuredOutputsParams
    assert choose_backend(StructuredOutputsParams(json=answer)) == "llguidance"  # alone
    client = TestClient(app, raise_server_exceptions=False)
    err = _body_error(client.post("/v1/chat/completions", json={**body, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}))
    assert err["param"] == "response_format", err
    assert "at $.properties." in err["message"] and "format.elements" not in err["message"]

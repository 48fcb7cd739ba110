"""POST /v1/responses (issue 14): the Responses API on the chat-completions path.

Fast unit tests of the request conversion, the store and the event writer; then
the real openai SDK (create, parse, stream, tools, previous_response_id)
against one real `formwork serve` on the default model (marked slow). Schemas
are bounded so that greedy SmolLM2-135M finishes quickly.
"""
from __future__ import annotations

import json
import os

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from formwork.gateway.errors import APIError
from formwork.gateway.responses_input import (chat_request, check_supported, input_messages,
                                              responses_error, truncation_starts)
from formwork.gateway.responses_store import ResponseStore, StoredResponse
from formwork.gateway.serving_responses import EventWriter, assistant_message, output_items
from formwork.schemas.openai import FunctionCall, ToolCall
from formwork.schemas.responses import ResponsesRequest

slow = pytest.mark.slow
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")     # no export to OpenAI
MAX_TOKENS = 120
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "weather", "description": "Weather in a city.",
                "parameters": CITY, "strict": True}


class Owner(BaseModel):
    name: str = Field(max_length=12)


class Pet(BaseModel):
    name: str = Field(max_length=12)
    owner: Owner


# ---- input items -> chat messages (no server) ---------------------------------------------

def test_string_input_is_one_user_message():
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


def _function_call(call_id: str, name: str, arguments: str) -> dict:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}


def test_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather "},
                     {"type": "input_text", "text": "in Oslo?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        _function_call("c1", "weather", '{"city":"Oslo"}'),
        _function_call("c2", "weather", '{"city":"Rome"}'),
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "sun"}]},
    ]
    call = lambda i, city: {"id": i, "type": "function",  # noqa: E731
                            "function": {"name": "weather", "arguments": f'{{"city":"{city}"}}'}}
    assert input_messages(items) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call("c1", "Oslo"),
                                                                    call("c2", "Rome")]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "sun"}]


def test_function_call_after_a_user_message_opens_an_assistant_message():
    msgs = input_messages([{"role": "user", "content": "x"},
                           _function_call("c", "f", "{}")])
    assert msgs[1]["role"] == "assistant" and msgs[1]["content"] is None
    assert msgs[1]["tool_calls"][0]["id"] == "c"


@pytest.mark.parametrize("items, param", [
    ([{"type": "web_search_call", "id": "w"}], "input[0].type"),
    ([{"type": "reasoning", "summary": []}], "input"),      # dropped: nothing is left
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
     "input[0].content[0].type"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
    ([], "input"),
])
def test_bad_items_name_their_field(items, param):
    with pytest.raises(APIError) as e:
        input_messages(items)
    assert e.value.status == 400 and e.value.param == param


def test_chat_request_maps_the_options():
    req = ResponsesRequest(input="hi", instructions="Be brief.", max_output_tokens=7,
                           temperature=0.5, top_p=0.9, parallel_tool_calls=False,
                           tools=[WEATHER_TOOL],
                           tool_choice={"type": "function", "name": "weather"},
                           text={"format": {"type": "json_schema", "name": "c", "schema": CITY,
                                            "strict": True}})
    chat = chat_request(req, input_messages(req.input))
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert chat.messages[0].content == "Be brief."
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.5 and chat.top_p == 0.9
    assert chat.parallel_tool_calls is False
    assert chat.tools[0].function.name == "weather" and chat.tools[0].function.parameters == CITY
    assert chat.tool_choice.function.name == "weather"
    assert chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema.json_schema == CITY


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
])
def test_unsupported_options_are_400(fields, param):
    with pytest.raises(APIError) as e:
        chat_request(ResponsesRequest(input="hi", **fields), [{"role": "user", "content": "hi"}])
    assert e.value.param == param


@pytest.mark.parametrize("fields, param", [({"background": True}, "background"),
                                           ({"conversation": "conv_1"}, "conversation"),
                                           ({"reasoning": {"effort": "maximum"}}, "reasoning.effort"),
                                           ({"reasoning": {"effort": "low", "depth": 3}},
                                            "reasoning.depth"),
                                           ({"reasoning": {"summary": "long"}}, "reasoning.summary"),
                                           ({"include": ["message.output_text.logprobs", "x"]},
                                            "include"),
                                           ({"top_logprobs": 21}, "top_logprobs"),
                                           ({"max_tool_calls": 0}, "max_tool_calls")])
def test_unsupported_fields_and_values_are_400(fields, param):
    check_supported(ResponsesRequest(
        input="hi", include=["message.output_text.logprobs", "reasoning.encrypted_content"],
        truncation="auto", reasoning={"effort": "low", "summary": "auto"}, top_logprobs=20,
        max_tool_calls=3, background=False))
    with pytest.raises(APIError) as e:
        check_supported(ResponsesRequest(input="hi", **fields))
    assert e.value.param == param


@pytest.mark.parametrize("fields, logprobs, top", [
    ({}, False, None),
    ({"include": ["message.output_text.logprobs"]}, True, 0),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 3}, True, 3),
    ({"top_logprobs": 2}, True, 2),
    ({"include": ["reasoning.encrypted_content"]}, False, None)])
def test_logprobs_and_effort_reach_the_chat_request(fields, logprobs, top):
    req = ResponsesRequest(input="hi", reasoning={"effort": "high"}, **fields)
    chat = chat_request(req, input_messages(req.input))
    assert chat.logprobs is logprobs and chat.top_logprobs == top
    assert chat.reasoning_effort == "high"
    assert chat_request(ResponsesRequest(input="hi"), [{"role": "user", "content": "hi"}]) \
        .reasoning_effort is None


def test_truncation_starts_at_later_user_messages_only():
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
            {"role": "tool", "content": "r", "tool_call_id": "1"},
            {"role": "user", "content": "d"}]
    assert truncation_starts(conv) == [2, 5]
    assert truncation_starts(conv[:1]) == []


def test_chat_errors_are_renamed_to_responses_fields():
    err = responses_error(APIError(400, "response_format.json_schema.schema: bad", param=
                                   "response_format.json_schema.schema"))
    assert err.param == "text.format.schema" and err.message == "text.format.schema: bad"
    assert responses_error(APIError(400, "x", param="max_completion_tokens")).param == \
        "max_output_tokens"
    ctx = responses_error(APIError(400, "... (9 in the messages, 5 in the completion). Please "
                                   "reduce the length of the messages or completion.",
                                   param="messages", code="context_length_exceeded"))
    assert ctx.param == "input" and "the messages" not in ctx.message
    assert ctx.code == "context_length_exceeded"
    same = APIError(400, "temperature: too hot", param="temperature")
    assert responses_error(same) is same


# ---- output shaping, store, events (no server) --------------------------------------------

def test_output_items_and_the_stored_assistant_message():
    calls = [ToolCall(id="call_1", function=FunctionCall(name="weather", arguments='{"city":"a"}'))]
    items = output_items(None, calls, cut=False)
    assert [i.type for i in items] == ["function_call"] and items[0].call_id == "call_1"
    assert assistant_message(items) == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city":"a"}'}}]}
    cut = output_items("hel", [], cut=True)
    assert cut[0].status == "incomplete" and cut[0].content[0].text == "hel"
    assert output_items(None, [], cut=False)[0].content[0].text == ""


def test_store_is_a_bounded_lru():
    store = ResponseStore(capacity=2)
    for rid in ("a", "b"):
        store.put(rid, StoredResponse({"id": rid}, []))
    store.get("a")                       # now the most recent: "b" goes first
    store.put("c", StoredResponse({"id": "c"}, []))
    assert len(store) == 2 and store.get("a") and store.get("c")
    with pytest.raises(APIError) as e:
        store.get("b")
    assert e.value.status == 404 and e.value.param == "previous_response_id"


def _events(chunks: list[str]) -> list[dict]:
    out = []
    for chunk in chunks:
        head, data = chunk.strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    return out


def test_event_writer_orders_text_then_call():
    w = EventWriter()
    chunks = w.text("Hel") + w.text("lo") + w.call("call_1", "weather") + w.arguments('{"c')
    chunks += w.arguments('":1}') + w.close("completed")
    events = _events(chunks)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    assert events[4]["text"] == "Hello" and events[10]["arguments"] == '{"c":1}'
    assert [i.type for i in w.items] == ["message", "function_call"]
    assert events[7]["output_index"] == 1 and events[7]["item"]["status"] == "in_progress"


class FakeEngine:
    """Yields the given text pieces as RequestOutputs (then `reason`), or raises `error`;
    one token per character (CharTokenizer's)."""

    def __init__(self, pieces: list[str], reason: str = "stop", error: Exception | None = None):
        self.pieces, self.reason, self.error = pieces, reason, error

    async def generate(self, request_id, prompt, prompt_ids, params):
        from formwork.gateway.output_processor import CompletionOutput, RequestOutput
        if self.error is not None:
            raise self.error
        text = ""
        for i, piece in enumerate(self.pieces):
            text += piece
            last = i == len(self.pieces) - 1
            out = CompletionOutput(index=0, text=text, token_ids=[ord(ch) for ch in text],
                                   finish_reason=self.reason if last else None,
                                   delta_text=piece, delta_token_ids=[ord(ch) for ch in piece])
            yield RequestOutput(request_id, prompt, prompt_ids, [out], finished=last)


class CharTokenizer:
    """One token per character (`</think>` is 8 of them: plain text here)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(ch) for ch in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))


async def _collect(engine: FakeEngine, store: ResponseStore,
                   reasoning: str | None = None, include_reasoning: bool = True) -> list[dict]:
    from formwork.gateway.metrics import Metrics, RequestTimer
    from formwork.gateway.serving import ServerState, stream_outputs
    from formwork.gateway.serving_chat import PreparedChat
    from formwork.gateway.serving_responses import _base, _stream
    from formwork.gateway.tools import ToolMode
    from formwork.schemas.sampling import SamplingParams

    state = ServerState(engine=engine, tokenizer=CharTokenizer(), served_model_names=("m",),
                        max_model_len=64, metrics=Metrics("m"))
    req = ResponsesRequest(input="hi", stream=True)
    prep = PreparedChat("m", "p", [1, 2, 3], SamplingParams(max_tokens=3), ToolMode("none", ()),
                        None, reasoning=reasoning, include_reasoning=include_reasoning)
    conversation = input_messages(req.input)
    base = _base(req, "m")
    outputs = stream_outputs(state, base.id, prep.prompt, prep.prompt_ids, prep.params,
                             RequestTimer())
    return _events([e async for e in _stream(state, store, req, prep, conversation, base,
                                              outputs)])


def test_stream_cut_by_max_output_tokens_ends_incomplete():
    import asyncio
    store = ResponseStore()
    events = asyncio.run(_collect(FakeEngine(["He", "l", "lo"], reason="length"), store))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]
    assert final["type"] == "response.incomplete"
    resp = final["response"]
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {
        "reason": "max_output_tokens"}
    assert resp["output"][0]["content"][0]["text"] == "Hello"
    assert resp["output"][0]["status"] == "incomplete"
    assert resp["usage"] == {"input_tokens": 3, "output_tokens": 5, "total_tokens": 8,
                             "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens_details": {"reasoning_tokens": 0}}
    stored = store.get(resp["id"])
    assert stored.conversation[-1] == {"role": "assistant", "content": "Hello"}


def test_stream_engine_error_is_an_error_event_and_nothing_is_stored():
    import asyncio

    from formwork.gateway.engine_client import EngineRequestError
    store = ResponseStore()
    events = asyncio.run(_collect(FakeEngine([], error=EngineRequestError("grammar failed")),
                                  store))
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1]["message"] == "grammar failed" and events[-1]["error"]["code"] == \
        "engine_request_error"
    assert len(store) == 0


# ---- HTTP errors before any engine work (no engine) ----------------------------------------

@pytest.fixture()
def app_client():
    from fastapi.testclient import TestClient

    from formwork.gateway.api_server import build_app
    from formwork.gateway.metrics import Metrics
    from formwork.gateway.serving import ServerState
    from formwork.schemas.config import EngineConfig

    app = build_app(EngineConfig(), served_model_names=["m"])
    app.state.server = ServerState(engine=None, tokenizer=None, served_model_names=("m",),
                                   max_model_len=1024, metrics=Metrics("m"))
    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize("body, status, param", [
    ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "file_search"}]}, 400, "tools[0].type"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type"),
    ({"instructions": "x"}, 400, "input"),
    ({"input": "hi", "model": "other"}, 404, "model"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": True}]}, 400,
     "tools[0].parameters"),
])
def test_http_errors_name_the_field(app_client, body, status, param):
    r = app_client.post("/v1/responses", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    spec = app_client.get("/openapi.json").json()["paths"]["/v1/responses"]["post"]
    assert "422" not in spec["responses"]


def test_get_or_delete_unknown_response_is_404(app_client):
    for r in (app_client.get("/v1/responses/resp_nope"),
              app_client.delete("/v1/responses/resp_nope")):
        assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"


# ---- the real server through the openai SDK -----------------------------------------------

@pytest.fixture(scope="module")
def client():
    from test_server import small_server_client
    yield from small_server_client()


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _check_usage(r) -> None:
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens


@slow
def test_create_plain(client, model):
    r = client.responses.create(model=model, input="Say hello.", max_output_tokens=16,
                                temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"
    assert r.output_text == r.output[0].content[0].text and r.output_text
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 16
    _check_usage(r)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


@slow
def test_vllms_extra_fields_reach_the_generation(client, model):
    """vLLM's extras on /v1/responses (extra_body): a structured_outputs constraint,
    stop strings, a seed; beside text.format or tools, one constraint per request.
    They were dropped without a word."""
    ask = "Is the sky blue? Answer yes or no."
    for stream in (False, True):
        kw = dict(model=model, input=ask, max_output_tokens=8, temperature=1.0,
                  extra_body={"structured_outputs": {"choice": ["maybe", "never"]}})
        if stream:
            with client.responses.stream(**kw) as s:
                for _ in s:
                    pass
                text = s.get_final_response().output_text
        else:
            text = client.responses.create(**kw).output_text
        assert text in ("maybe", "never"), text
    free = client.responses.create(model=model, input="Count: one, two, three, four, five.",
                                   max_output_tokens=24, temperature=0)
    cut = client.responses.create(model=model, input="Count: one, two, three, four, five.",
                                  max_output_tokens=24, temperature=0, extra_body={"stop": [","]})
    assert "," not in cut.output_text and free.output_text.startswith(cut.output_text)
    # the first run fills the prefix cache; later ones hit it (bf16: the same shapes, so
    # the same logits; README "Reproducibility")
    seeded = [client.responses.create(model=model, input="Tell me a story.", max_output_tokens=12,
                                      temperature=1.0, extra_body={"seed": 7}).output_text
              for _ in range(3)]
    assert seeded[1] == seeded[2]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input=ask, max_output_tokens=4,
                                text={"format": {"type": "json_object"}},
                                extra_body={"structured_outputs": {"regex": "[0-9]+"}})
    assert e.value.param == "structured_outputs" and "text.format" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input=ask, max_output_tokens=4,
                                extra_body={"top_k": "many"})
    assert e.value.param == "top_k"


@slow
@pytest.mark.parametrize("stream", [False, True])
def test_output_text_logprobs(client, model, stream):
    """include message.output_text.logprobs + top_logprobs: one entry per output token,
    whose bytes spell the text; greedy, so each token is its own first alternative;
    streamed, the deltas carry the same entries as the final part."""
    kw = dict(model=model, input="Count from one to ten.", max_output_tokens=12, temperature=0,
              include=["message.output_text.logprobs"], top_logprobs=3)
    deltas = []
    if stream:
        for e in client.responses.create(stream=True, **kw):
            if e.type == "response.output_text.delta":
                deltas += e.logprobs
            elif e.type in ("response.completed", "response.incomplete"):
                r = e.response
    else:
        r = client.responses.create(**kw)
    assert r.top_logprobs == 3
    part = r.output[0].content[0]
    lps = part.logprobs
    # one entry per output token but the end of sequence (not in the text)
    assert len(lps) == r.usage.output_tokens - (r.status == "completed") and part.text
    assert bytes(b for lp in lps for b in lp.bytes).decode() == part.text
    for lp in lps:
        assert len(lp.top_logprobs) == 3 and lp.logprob <= 0
        assert lp.top_logprobs[0].token == lp.token and lp.top_logprobs[0].logprob == lp.logprob
    if stream:
        assert [(d.token, d.logprob) for d in deltas] == [(lp.token, lp.logprob) for lp in lps]
    plain = client.responses.create(**{k: v for k, v in kw.items()
                                       if k not in ("include", "top_logprobs")})
    assert plain.output_text == part.text and not plain.output[0].content[0].logprobs


@slow
def test_truncation_auto_drops_the_oldest_turns(client, model):
    """Five ~250-token user turns do not fit the server's 1024 tokens: a 400
    context_length_exceeded, unless truncation is "auto": then the first turns are
    dropped, only as many as needed (one more turn would not fit)."""
    turn = "word " * 250
    conv = []
    for i in range(5):
        conv += [{"role": "user", "content": f"Note {i}: {turn}"},
                 {"role": "assistant", "content": "Noted."}]
    conv.append({"role": "user", "content": "How many notes?"})
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input=conv, max_output_tokens=8)
    assert e.value.code == "context_length_exceeded" and e.value.param == "input"
    r = client.responses.create(model=model, input=conv, max_output_tokens=8, temperature=0,
                                truncation="auto", reasoning={"effort": "low"})
    assert r.truncation == "auto" and r.reasoning.effort == "low" and r.output_text
    assert 1024 - 8 - 2 * 260 < r.usage.input_tokens <= 1024 - 8
    assert r.usage.output_tokens_details.reasoning_tokens == 0


@slow
def test_parse_text_format(client, model):
    r = client.responses.parse(model=model, input="Alice has a dog named Rex. Describe it as JSON.",
                               text_format=Pet, max_output_tokens=MAX_TOKENS, temperature=0)
    assert r.status == "completed"
    pet = r.output_parsed
    assert isinstance(pet, Pet)
    jsonschema.validate(pet.model_dump(mode="json"), Pet.model_json_schema())


@slow
def test_required_tool_then_its_result(client, model):
    r = client.responses.create(model=model, input="What is the weather in Paris?",
                                tools=[WEATHER_TOOL], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=MAX_TOKENS,
                                temperature=0)
    assert r.status == "completed"
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), CITY)
    # the tool's result goes back on top of the stored response
    r2 = client.responses.create(
        model=model, previous_response_id=r.id, tools=[WEATHER_TOOL], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        max_output_tokens=24, temperature=0)
    assert r2.previous_response_id == r.id and r2.output[0].type == "message"
    # the same conversation spelled out as items gives the same prompt
    explicit = client.responses.create(
        model=model, tools=[WEATHER_TOOL], tool_choice="none", max_output_tokens=24, temperature=0,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert explicit.usage.input_tokens == r2.usage.input_tokens
    assert explicit.output_text == r2.output_text


@slow
def test_stream_deltas_equal_the_final_text(client, model):
    events = list(client.responses.create(model=model, input="Count to five.",
                                          max_output_tokens=24, temperature=0, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert types[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == final.output_text == events[-4].text
    _check_usage(final)


@slow
def test_stream_helper_parses_and_streams_tool_arguments(client, model):
    with client.responses.stream(model=model, input="Alice has a dog named Rex. As JSON.",
                                 text_format=Pet, max_output_tokens=MAX_TOKENS,
                                 temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and isinstance(final.output_parsed, Pet)
    assert client.responses.retrieve(final.id).output_text == final.output_text   # stored
    events = list(client.responses.create(
        model=model, input="Weather in Oslo?", tools=[WEATHER_TOOL], stream=True,
        tool_choice={"type": "function", "name": "weather"}, max_output_tokens=MAX_TOKENS,
        temperature=0))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert events[-1].type == "response.completed" and args == done.arguments
    jsonschema.validate(json.loads(args), CITY)
    assert events[-1].response.output[0].arguments == args


@slow
def test_previous_response_id_continues(client, model):
    r1 = client.responses.create(model=model, input="My name is Ann.", max_output_tokens=8,
                                 temperature=0, instructions="Answer in one short sentence.")
    r2 = client.responses.create(model=model, input="What is my name?", previous_response_id=r1.id,
                                 max_output_tokens=8, temperature=0)
    assert r2.previous_response_id == r1.id and r2.output_text
    alone = client.responses.create(model=model, input="What is my name?", max_output_tokens=1)
    # r1's input and output are in r2's prompt
    assert r2.usage.input_tokens > alone.usage.input_tokens + r1.usage.output_tokens
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, input="hi", previous_response_id="resp_nope")
    assert e.value.param == "previous_response_id"
    unstored = client.responses.create(model=model, input="hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="hi", previous_response_id=unstored.id)


@slow
@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"background": True}, "background"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format"),
])
def test_unsupported_is_400(client, model, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="hi", max_output_tokens=4, **fields)
    assert e.value.param == param


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_stream_splits_thinking_into_a_reasoning_item(reason):
    """Under a reasoning parser the thinking is a `reasoning` item (reasoning_text
    events, a tag cut between deltas included) before the message; the final response
    holds the items the events built, equal to the non-streamed items; the stored
    conversation keeps the answer only."""
    import asyncio
    store = ResponseStore()
    pieces = ["<think>Let", " me</th", "ink>\n\n", "Hel", "lo"]
    if reason == "length":
        pieces = ["<think>Let", " me"]                  # cut while thinking
    events = asyncio.run(_collect(FakeEngine(pieces, reason=reason), store, reasoning="qwen3"))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta"]
    assert events[3]["part"] == {"type": "reasoning_text", "text": ""}
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == "Let me"
    assert next(e for e in events if e["type"] == "response.reasoning_text.done")["text"] == thought
    resp = events[-1]["response"]
    answer = "Hello" if reason == "stop" else None
    expected = output_items(answer, [], reason == "length", "Let me")
    assert [(i["type"], i["status"]) for i in resp["output"]] == \
        [(i.type, i.status) for i in expected] == \
        [("reasoning", "completed"), ("message", "incomplete" if answer is None else "completed")]
    assert resp["output"][0]["content"] == [{"type": "reasoning_text", "text": "Let me"}]
    assert resp["output"][1]["content"][0]["text"] == (answer or "")
    assert store.get(resp["id"]).conversation[-1] == {"role": "assistant", "content": answer}
    # the thinking's tokens: re-tokenized up to its end tag; all of them when cut inside it
    thinking_tokens = len("<think>Let me</think>") if reason == "stop" else len("".join(pieces))
    assert resp["usage"]["output_tokens_details"] == {"reasoning_tokens": thinking_tokens}


def test_include_reasoning_false_leaves_the_reasoning_item_out():
    """vLLM's include_reasoning false: no reasoning item or events, the same answer;
    the thinking's tokens are still counted."""
    import asyncio
    pieces = ["<think>Let", " me</th", "ink>\n\n", "Hel", "lo"]
    events = asyncio.run(_collect(FakeEngine(pieces, reason="stop"), ResponseStore(),
                                  reasoning="qwen3", include_reasoning=False))
    assert not any("reasoning" in e["type"] for e in events)
    resp = events[-1]["response"]
    assert [i["type"] for i in resp["output"]] == ["message"]
    assert resp["output"][0]["content"][0]["text"] == "Hello"
    assert resp["usage"]["output_tokens_details"] == {"reasoning_tokens": len("<think>Let me</think>")}


def test_reasoning_items_sent_back_are_left_out():
    """An agent's history carries the reasoning items of earlier turns: accepted, and
    left out of the prompt (chat templates drop earlier thinking)."""
    msgs = input_messages([{"type": "reasoning", "id": "rs_1", "summary": [],
                            "content": [{"type": "reasoning_text", "text": "hm"}]},
                           {"role": "user", "content": "hi"}])
    assert msgs == [{"role": "user", "content": "hi"}]

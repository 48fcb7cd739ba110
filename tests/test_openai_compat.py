"""Issue 14 without a model: what popular clients send must work unmodified.

Tool schemas with `$defs` under tool_choice required, tools together with
response_format, fields that were silently ignored (logit_bias, vLLM's
structured-output options, stop strings under a constraint), and the small
protocol points (absent tool_calls, temperature bound, legacy function role,
impossible min_tokens, GET /v1/models/{id})."""
from __future__ import annotations

import copy
import json
from enum import Enum
from types import SimpleNamespace

import jsonschema
import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from formwork.gateway.errors import APIError, install_error_handlers
from formwork.gateway.params import sampling_params, structured_from_request, validate_constraint
from formwork.gateway.tools import resolve_tool_mode
from formwork.gpu.sampler import Sampler, logit_bias_tensors
from formwork.schemas.openai import ChatCompletionRequest, ResponseMessage, ToolCall
from formwork.schemas.sampling import SamplingParams

MSGS = [{"role": "user", "content": "hi"}]


class Unit(str, Enum):
    c = "celsius"
    f = "fahrenheit"


class Place(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Forecast(BaseModel):
    place: Place
    unit: Unit
    days: int = Field(ge=1, le=7)


FORECAST = {"type": "function", "function": {"name": "forecast",
                                             "parameters": Forecast.model_json_schema()}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"], "additionalProperties": False}}}
# zod-to-json-schema's shape: draft-07, `definitions`, and a ref into `properties`
ZOD = {"type": "function", "function": {"name": "move", "parameters": {
    "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
    "properties": {"from": {"$ref": "#/definitions/Point"}, "to": {"$ref": "#/properties/from"}},
    "required": ["from", "to"], "additionalProperties": False,
    "definitions": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}},
                              "required": ["x"], "additionalProperties": False}}}}}
GOOD_ARGS = {"place": {"city": "Paris", "country": "France"}, "unit": "celsius", "days": 3}


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"model": "m", "messages": MSGS, **kw})


def constraint(**kw):
    req = chat(**kw)
    return structured_from_request(req, resolve_tool_mode(req))


def params(req: ChatCompletionRequest, vocab_size: int | None = None) -> SamplingParams:
    structured, _ = structured_from_request(req, resolve_tool_mode(req))
    return sampling_params(req, max_tokens=8, logprobs=None, structured=structured,
                           vocab_size=vocab_size)


# ---- 1. $defs under tool_choice required ---------------------------------------------

@pytest.mark.parametrize("parallel", [True, False])
def test_required_tools_with_defs_resolve(parallel):
    tools = [FORECAST, WEATHER, ZOD]
    before = copy.deepcopy(tools)
    so, source = constraint(tools=tools, tool_choice="required", parallel_tool_calls=parallel)
    validate_constraint(so, source)           # was a 400: '#/$defs/Place' did not resolve
    schema = so.json
    call = {"name": "forecast", "arguments": GOOD_ARGS}
    zod = {"name": "move", "arguments": {"from": {"x": 1}, "to": {"x": 2}}}
    for ok in (call, zod):
        jsonschema.validate([ok] if parallel else ok, schema)
    bad_unit = {"name": "forecast", "arguments": {**GOOD_ARGS, "unit": "kelvin"}}
    bad_to = {"name": "move", "arguments": {"from": {"x": 1}, "to": {"x": "2"}}}
    for bad in (bad_unit, bad_to):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([bad] if parallel else bad, schema)
    assert set(schema["$defs"]) == {"forecast.Place", "forecast.Unit"}
    assert set(schema["definitions"]) == {"move.Point"}
    assert tools == before                    # the request's schemas are not mutated


STORE_ID = "https://json.schemastore.org/cloudbuild"
WITH_ID = {"type": "function", "function": {"name": "build", "parameters": {
    "$schema": "http://json-schema.org/draft-07/schema#", "$id": STORE_ID, "type": "object",
    "definitions": {"Step": {"type": "object", "properties": {"name": {"type": "string"}},
                             "required": ["name"], "additionalProperties": False}},
    "properties": {"steps": {"type": "array", "items": {"$ref": "#/definitions/Step"}},
                   "first": {"$ref": f"{STORE_ID}#/definitions/Step"}},
    "required": ["steps"]}}}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_with_an_id_resolves_its_refs(parallel):
    """A parameters schema with its own `$id` (every SchemaStore schema has one): left
    inside the wrapper, it made `#/definitions/...` resolve against the embedded
    root, which no longer holds them (400 'nothing at that JSON pointer')."""
    so, source = constraint(tools=[WITH_ID, FORECAST], tool_choice="required", parallel_tool_calls=parallel)
    validate_constraint(so, source)
    assert "$id" not in json.dumps(so.json)
    ok = {"name": "build", "arguments": {"steps": [{"name": "go"}], "first": {"name": "a"}}}
    jsonschema.validate([ok] if parallel else ok, so.json)
    for bad in ({"steps": [{"name": 1}]}, {"steps": [], "first": {"nom": "a"}}):
        call = {"name": "build", "arguments": bad}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([call] if parallel else call, so.json)
    assert WITH_ID["function"]["parameters"]["$id"] == STORE_ID       # not mutated


def test_required_tools_with_defs_compile_and_accept_a_call():
    from formwork.gpu.model_files import load_model_tokenizer
    from formwork.grammar.vocab import TokenVocab
    from formwork.grammar.xgrammar_backend import XGrammarBackend
    tok = load_model_tokenizer(None)
    vocab = TokenVocab.from_tokenizer(tok, 49152)
    so, _ = constraint(tools=[FORECAST], tool_choice="required", parallel_tool_calls=False)
    m = XGrammarBackend(vocab).compile(so).new_matcher()
    text = json.dumps({"name": "forecast", "arguments": GOOD_ARGS})
    assert m.accept_tokens(tok.encode(text, add_special_tokens=False))
    assert m.accept_tokens([vocab.eos_token_id]) and m.is_terminated()


def test_unresolvable_ref_is_named_plainly():
    bad = {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}
    with pytest.raises(APIError) as e:
        validate_constraint(*constraint(response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": bad}}))
    assert "nothing at that JSON pointer" in e.value.message and "only" not in e.value.message


# ---- 2. tools together with response_format ------------------------------------------

ANSWER = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"verdict": {"enum": ["yes", "no"]}},
    "required": ["verdict"], "additionalProperties": False}}}


def test_tools_with_response_format_per_tool_choice():
    so, source = constraint(tools=[WEATHER], response_format=ANSWER)            # auto
    assert source == "tools" and so.structural_tag["format"]["type"] == "or"
    validate_constraint(so, source)
    so, source = constraint(tools=[WEATHER], response_format=ANSWER, tool_choice="none")
    assert source == "response_format" and so.json == ANSWER["json_schema"]["schema"]
    so, _ = constraint(tools=[WEATHER], response_format=ANSWER, tool_choice="required")
    assert so.json["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    with pytest.raises(APIError) as e:           # vLLM's own constraint next to tools: ambiguous
        constraint(tools=[WEATHER], structured_outputs={"regex": "a+"})
    assert e.value.param == "tools" and "only one output constraint" in e.value.message


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("parallel", [True, False])
def test_auto_with_response_format_is_an_answer_or_calls(parallel, backend):
    """The same language on both backends (llguidance takes it where xgrammar refuses
    a tool's or the answer's schema: next test)."""
    from formwork.gpu.model_files import load_model_tokenizer
    from formwork.grammar.manager import build_backend
    from formwork.grammar.vocab import TokenVocab
    tok = load_model_tokenizer(None)
    vocab = TokenVocab.from_tokenizer(tok, 49152)
    so, _ = constraint(tools=[WEATHER, FORECAST], response_format=ANSWER,
                       parallel_tool_calls=parallel)
    compiled = build_backend(backend, vocab, tok).compile(so)

    def accepts(text: str) -> bool:
        m = compiled.new_matcher()
        return (m.accept_tokens(tok.encode(text, add_special_tokens=False))
                and m.accept_tokens([vocab.eos_token_id]) and m.is_terminated())
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    call2 = ('<tool_call>\n{"name": "forecast", "arguments": ' + json.dumps(GOOD_ARGS)
             + '}\n</tool_call>')
    assert accepts('{"verdict": "yes"}') and accepts(call) and accepts(call2)
    assert accepts(call + "\n" + call2) == parallel
    for bad in ('{"verdict": "maybe"}', "free text", "Sure. " + call, '{"verdict": "no"} ' + call):
        assert not accepts(bad), bad


def test_auto_with_response_format_and_a_pattern_tool_is_served_exactly():
    """A tool with a `pattern` beside a response_format (the shape openai-agents sends
    for an agent with tools and an output type): xgrammar refuses the pattern, so
    llguidance serves the answer-or-calls language, the pattern exact."""
    from formwork.gpu.model_files import load_model_tokenizer
    from formwork.grammar.manager import build_backend
    from formwork.grammar.selection import choose_backend
    from formwork.grammar.vocab import TokenVocab
    tok = load_model_tokenizer(None)
    vocab = TokenVocab.from_tokenizer(tok, 49152)
    code = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]+$"}},
        "required": ["code"], "additionalProperties": False}}}
    so, _ = constraint(tools=[code, WEATHER], response_format=ANSWER)
    assert choose_backend(so) == "llguidance"
    compiled = build_backend("llguidance", vocab, tok).compile(so)

    def accepts(text: str) -> bool:
        m = compiled.new_matcher()
        return (m.accept_tokens(tok.encode(text, add_special_tokens=False))
                and m.accept_tokens([vocab.eos_token_id]) and m.is_terminated())
    call = '<tool_call>\n{"name": "lookup", "arguments": {"code": "AB12"}}\n</tool_call>'
    assert accepts('{"verdict": "yes"}') and accepts(call) and accepts(call + "\n" + call)
    for bad in (call.replace("AB12", "ab12"), call.replace("AB12", "AB"), '{"verdict": "maybe"}',
                "free text", '{"verdict": "no"} ' + call):
        assert not accepts(bad), bad


# ---- 3. fields that were ignored: honoured or refused --------------------------------

def test_logit_bias_maps_and_is_checked_naming_the_field():
    p = params(chat(logit_bias={"5": -100, "7": 2.5}), vocab_size=100)
    assert p.logit_bias == {5: -100.0, 7: 2.5}
    for bias, words in (({"x": 1}, "token ids"), ({"5": 101}, "[-100, 100]"),
                        ({"100": 1}, "outside the vocabulary")):
        with pytest.raises(APIError) as e:
            params(chat(logit_bias=bias), vocab_size=100)
        assert e.value.param == "logit_bias" and words in e.value.message


def _batch(n, **kw):
    from formwork.gpu.sampler import SamplingBatch
    base = dict(temperature=torch.zeros(n), top_p=None, top_k=None, min_p=None, all_greedy=True,
                seeds=[None] * n, presence=None, frequency=None, repetition=None,
                output_token_ids=None, all_token_ids=None, max_num_logprobs=None,
                num_logprobs=[None] * n)
    return SamplingBatch(**(base | kw))


def test_sampler_applies_logit_bias_before_mask_and_sampling():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 50                 # spread wide: -100 alone would not ban
    top = logits.argmax(-1)
    second = logits.topk(2).indices[:, 1]
    bias = [{int(top[0]): -100}, None, {int(second[2]): 100.0}]
    batch = _batch(3, logit_bias=logit_bias_tensors(bias, "cpu"))
    out = Sampler()(logits.clone(), batch)
    assert out.token_ids[0] != int(top[0])           # -100 bans
    assert out.token_ids[1] == int(top[1])           # a row without a bias is untouched
    assert out.token_ids[2] == int(second[2])
    # sampled rows too: a banned token never comes out
    hot = _batch(1, temperature=torch.ones(1), all_greedy=False,
                 logit_bias=logit_bias_tensors([{int(top[0]): -100}], "cpu"))
    flat = torch.zeros(1, 50)
    flat[0, int(top[0])] = 5.0
    assert all(Sampler()(flat.clone(), hot).token_ids[0] != int(top[0]) for _ in range(50))
    # the grammar mask still rules: a bias cannot allow what the mask forbids
    mask = torch.zeros(1, 2, dtype=torch.int32)
    mask[0, 0] = 1 << 3                              # only token 3 allowed
    boosted = _batch(1, logit_bias=logit_bias_tensors([{9: 100.0}], "cpu"))
    assert Sampler()(torch.zeros(1, 50), boosted, mask, torch.tensor([0])).token_ids == [3]
    assert logit_bias_tensors([None, {}], "cpu") is None


def test_vllm_structured_output_options_are_honoured_or_refused():
    base = {"response_format": ANSWER}
    so, _ = constraint(structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True})
    assert so.whitespace == "compact"
    so, _ = constraint(**base, structured_outputs={"disable_any_whitespace": True,
                                                   "disable_additional_properties": True})
    assert (so.whitespace, so.additional_properties) == ("compact", "declared")
    so, _ = constraint(**base, guided_decoding_backend="xgrammar:disable-any-whitespace,no-fallback")
    assert (so.backend, so.whitespace) == ("xgrammar", "compact")
    so, _ = constraint(guided_json={"type": "object"}, guided_whitespace_pattern="[ \\n]{0,2}")
    assert so.whitespace_pattern == "[ \\n]{0,2}"
    from formwork.grammar.selection import choose_backend
    assert choose_backend(so) == "llguidance"
    validate_constraint(so, "structured_outputs")
    refused = [
        ({"structured_outputs": {"json": {}, "no_such_option": 1}}, "structured_outputs.no_such_option"),
        ({**base, "guided_decoding_backend": "xgrammar:turbo"}, "guided_decoding_backend"),
        ({**base, "structured_outputs": {"whitespace": "flexible", "disable_any_whitespace": True}},
         "structured_outputs.disable_any_whitespace"),
    ]
    for kw, param in refused:
        with pytest.raises(APIError) as e:
            constraint(**kw)
        assert e.value.param == param, kw
    for kw in ({"guided_json": {}, "guided_whitespace_pattern": "[a-z ]*"},       # not whitespace
               {"guided_json": {}, "guided_whitespace_pattern": "[ ]*", "guided_decoding_backend": "xgrammar"},
               {"guided_regex": "a+", "guided_whitespace_pattern": " *"}):
        so, source = constraint(**kw)
        with pytest.raises(APIError) as e:
            validate_constraint(so, source)
        assert "whitespace_pattern" in e.value.message, kw


@pytest.mark.parametrize("pattern,ok", [
    (" *", True), ("[ \\t\\n\\r]{0,4}", True), ("(?:\\n|\\x20)+", True), ("\\u0020?", True),
    ("\\s*", False), ("[^a]*", False), ("[\\x09-\\x20]*", False), (".", False), ("[|*]", False),
    ("a", False), ("{2}", False), ("]", False), ("(?i) ", False)])
def test_whitespace_pattern_check(pattern, ok):
    from formwork.schemas.structured import check_whitespace_pattern
    if ok:
        check_whitespace_pattern(pattern)
    else:
        with pytest.raises(ValueError, match="whitespace_pattern"):
            check_whitespace_pattern(pattern)


def test_stop_strings_apply_under_a_constraint(tokenizer):
    from formwork.gateway.output_processor import OutputProcessor
    from formwork.schemas.engine import EngineCoreOutput
    from formwork.schemas.structured import StructuredOutputsParams
    sp = SamplingParams(max_tokens=64, stop=["END"],
                        structured_outputs=StructuredOutputsParams(regex="[A-Z ]+"))
    op = OutputProcessor(tokenizer)
    (ereq,) = op.add_request("r", "p", [1, 2], sp)
    ids = tokenizer.encode("AB END CD", add_special_tokens=False)
    outs, abort = op.process_outputs([EngineCoreOutput(request_id=ereq.request_id,
                                                       new_token_ids=ids)])
    c = outs[0].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("AB ", "stop", "END")
    assert abort == [ereq.request_id]


def _processed(tokenizer, sp, ids, *, finish=None, stop_reason=None, chunks=1):
    """The text an OutputProcessor makes of `ids` sent in `chunks` engine outputs, the
    last one finishing with `finish` / `stop_reason`."""
    from formwork.gateway.output_processor import OutputProcessor
    from formwork.schemas.engine import EngineCoreOutput, FinishReason
    op = OutputProcessor(tokenizer)
    (ereq,) = op.add_request("r", "p", [1, 2], sp)
    cut = len(ids) // chunks
    parts = [ids[i * cut:(i + 1) * cut] for i in range(chunks - 1)] + [ids[(chunks - 1) * cut:]]
    for k, part in enumerate(parts):
        last = k == len(parts) - 1
        outs, _ = op.process_outputs([EngineCoreOutput(
            request_id=ereq.request_id, new_token_ids=part,
            finish_reason=FinishReason(finish) if last and finish else None,
            stop_reason=stop_reason if last else None)])
        if outs and outs[0].outputs[0].finished:
            break
    return outs[0].outputs[0]


@pytest.mark.parametrize("chunks", [1, 3])
def test_the_token_that_ends_an_output_is_not_written_into_its_text(tokenizer, chunks):
    """As vLLM: the end token, or a stop token id, stays in token_ids but not in the
    text (unless include_stop_str_in_output). With skip_special_tokens=False a JSON
    output came back as `{"a": 1}<|im_end|>`, which no client parses."""
    body = tokenizer.encode('{"a": 1}', add_special_tokens=False)
    eos = tokenizer.eos_token_id
    raw = SamplingParams(max_tokens=64, skip_special_tokens=False)
    c = _processed(tokenizer, raw, body + [eos], finish="stop", chunks=chunks)
    assert (c.text, list(c.token_ids)) == ('{"a": 1}', body + [eos])
    c = _processed(tokenizer, raw.clone(include_stop_str_in_output=True), body + [eos],
                   finish="stop", chunks=chunks)
    assert c.text == '{"a": 1}' + tokenizer.decode([eos])
    dot = tokenizer.encode(".", add_special_tokens=False)[0]
    words = tokenizer.encode("Hi there", add_special_tokens=False)
    sp = SamplingParams(max_tokens=64, stop_token_ids=[dot])
    c = _processed(tokenizer, sp, words + [dot], finish="stop", stop_reason=dot, chunks=chunks)
    assert (c.text, c.token_ids[-1], c.stop_reason) == ("Hi there", dot, dot)
    c = _processed(tokenizer, sp.clone(include_stop_str_in_output=True), words + [dot],
                   finish="stop", stop_reason=dot, chunks=chunks)
    assert c.text == "Hi there."
    # a grammar that ended on a content token keeps it; an output cut at max_tokens too
    c = _processed(tokenizer, SamplingParams(max_tokens=64), body, finish="stop", chunks=chunks)
    assert c.text == '{"a": 1}'
    c = _processed(tokenizer, raw.clone(ignore_eos=True), body + [eos], finish="length",
                   chunks=chunks)
    assert c.text == '{"a": 1}' + tokenizer.decode([eos])
    # under ignore_eos an output still ends on the end token where its grammar ended
    c = _processed(tokenizer, raw.clone(ignore_eos=True), body + [eos], finish="stop",
                   chunks=chunks)
    assert c.text == '{"a": 1}'


def test_the_earliest_stop_string_cuts(tokenizer):
    """OpenAI: the text holds no stop sequence. With stop ["a", "e"] a token " Armenia"
    was cut at its "a" (the list's first found) to " Armeni", which holds an "e";
    the earliest match cuts, and at one position the list's first is named."""
    ids = tokenizer.encode(" Armenia and more", add_special_tokens=False)
    c = _processed(tokenizer, SamplingParams(max_tokens=64, stop=["a", "e"]), ids)
    assert (c.text, c.stop_reason) == (" Arm", "e")
    c = _processed(tokenizer, SamplingParams(max_tokens=64, stop=["a", "e"],
                                             include_stop_str_in_output=True), ids)
    assert (c.text, c.stop_reason) == (" Arme", "e")
    ids = tokenizer.encode("xaby", add_special_tokens=False)
    for stops, named in ((["ab", "a"], "ab"), (["a", "ab"], "a")):
        c = _processed(tokenizer, SamplingParams(max_tokens=64, stop=stops), ids)
        assert (c.text, c.stop_reason) == ("x", named)


def test_stop_strings_wait_for_min_tokens(tokenizer):
    """As vLLM (its PR 22014): a stop string counts only in text that comes after the
    first min_tokens tokens; before, it was cut at once (an output of 1 token under
    min_tokens 18)."""
    ids = tokenizer.encode(" is Lee, and I'm a student in the college", add_special_tokens=False)
    cut = _processed(tokenizer, SamplingParams(max_tokens=64, stop=["e"]), ids)
    assert (cut.text, cut.stop_reason) == (" is L", "e")
    late = _processed(tokenizer, SamplingParams(max_tokens=64, stop=["e"], min_tokens=5), ids)
    prefix = tokenizer.decode(ids[:5])
    assert late.stop_reason == "e" and late.text.startswith(prefix) and len(late.token_ids) > 5
    assert "e" not in late.text[len(prefix):] and "e" in prefix
    # a longer stop string beside it widens the text held back for a match across
    # tokens; a short one that ended inside those first tokens was then found by the
    # next token and the output cut back into them (" is L" under min_tokens 2)
    for n in (2, 5):
        sp = SamplingParams(max_tokens=64, stop=["e", "zzzzzzzz"], min_tokens=n)
        for chunks in (1, 3):
            c = _processed(tokenizer, sp, ids, chunks=chunks)
            prefix = tokenizer.decode(ids[:n])
            assert c.text.startswith(prefix) and c.stop_reason == "e", (n, chunks, c.text)


# ---- 4. smalls ------------------------------------------------------------------------

def test_tool_calls_absent_when_none_called():
    assert "tool_calls" not in ResponseMessage(content="hi").model_dump(mode="json")
    call = ToolCall(function={"name": "f", "arguments": "{}"})
    assert ResponseMessage(tool_calls=[call]).model_dump(mode="json")["tool_calls"][0]["id"]


def test_temperature_over_two_is_refused():
    assert params(chat(temperature=2)).temperature == 2
    with pytest.raises(APIError) as e:
        params(chat(temperature=2.5))
    assert e.value.param == "temperature" and "[0, 2]" in e.value.message


def test_function_role_and_function_call_render_as_tool_messages(tokenizer):
    from formwork.gateway.chat import build_chat_prompt
    req = chat(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None,
         "function_call": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"role": "function", "name": "get_weather", "content": "sunny"}])
    prompt, _ = build_chat_prompt(tokenizer, req.messages, resolve_tool_mode(req))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert "<|im_start|>tool\n<tool_response>\nsunny\n</tool_response>" in prompt


def test_min_tokens_beyond_any_choice_is_refused_before_queueing():
    assert params(chat(guided_choice=["yes", "no"], min_tokens=3)).min_tokens == 3
    with pytest.raises(APIError) as e:
        params(chat(guided_choice=["yes", "no"], min_tokens=4, max_tokens=8))
    assert e.value.param == "min_tokens" and "choice" in e.value.message


def test_get_model_by_id():
    from formwork.gateway.routes import router
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(router)
    from formwork.gateway.serving import ServerState
    app.state.server = ServerState(engine=SimpleNamespace(config=SimpleNamespace(model=None)),
                                   tokenizer=None, served_model_names=("m1", "org/m2"),
                                   max_model_len=512,
                                   metrics=SimpleNamespace(observe_error=lambda status: None))
    client = TestClient(app)
    for name in ("m1", "org/m2"):
        r = client.get(f"/v1/models/{name}")
        assert r.status_code == 200
        assert {k: r.json()[k] for k in ("id", "object", "max_model_len")} == {
            "id": name, "object": "model", "max_model_len": 512}
    r = client.get("/v1/models/nope")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"


def test_logit_bias_through_the_engine_process(tiny_model_dir):
    """The bias crosses the process boundary (msgpack, int keys) and reaches the sampler:
    banning the greedy first token changes it; an id past the vocabulary is refused."""
    from formwork import LLM
    llm = LLM(str(tiny_model_dir), engine_process=True, dtype="float32", num_kv_blocks=32)
    try:
        prompt = [{"prompt_token_ids": [5, 6, 7]}]
        greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        first = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
        banned = greedy.clone(logit_bias={first: -100.0})
        again = llm.generate(prompt, banned, use_tqdm=False)[0].outputs[0].token_ids
        assert again[0] != first
        with pytest.raises(ValueError, match="^logit_bias: token id"):
            llm.generate(prompt, greedy.clone(logit_bias={10**6: 1.0}), use_tqdm=False)
    finally:
        llm.shutdown()

"""parallel_tool_calls=false is enforced by the grammar (tool_choice auto and
required): the compiled constraint accepts one call and rejects a second, and
the real model, asked to repeat two calls, generates exactly one."""
from __future__ import annotations

import json

import pytest

from formwork.gateway.tool_parser import parse_tool_output
from formwork.gateway.tools import resolve_tool_mode, tool_constraint
from formwork.schemas.openai import ChatCompletionRequest

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
OBJ = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
OBJ2 = '{"name": "get_time", "arguments": {"tz": "UTC"}}'
REPEAT = [{"role": "user", "content": f"Repeat exactly: {CALL}\n{CALL2}"}]


def _mode(choice: str, parallel: bool, messages=REPEAT):
    return resolve_tool_mode(ChatCompletionRequest(
        messages=messages, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=parallel))


@pytest.fixture(scope="module")
def grammar():
    from formwork.gpu.model_files import load_model_tokenizer
    from formwork.grammar.vocab import TokenVocab
    from formwork.grammar.xgrammar_backend import XGrammarBackend
    tok = load_model_tokenizer(None)
    vocab = TokenVocab.from_tokenizer(tok, 49152)
    backend = XGrammarBackend(vocab)

    def accepts(choice: str, parallel: bool, text: str) -> bool:
        m = backend.compile(tool_constraint(_mode(choice, parallel))).new_matcher()
        ids = tok.encode(text, add_special_tokens=False)
        return (m.accept_tokens(ids) and m.accept_tokens([vocab.eos_token_id])
                and m.is_terminated())
    return accepts


def test_auto_constraint_stops_after_first_call_unless_parallel(grammar):
    assert tool_constraint(_mode("auto", False)).structural_tag["format"]["stop_after_first"]
    for text in ("Just text.", "Sure. " + CALL):
        assert grammar("auto", False, text) and grammar("auto", True, text)
    for text in (CALL + CALL2, CALL + "\n" + CALL2, "x " + CALL + "\n" + CALL, CALL + " done"):
        assert not grammar("auto", False, text), text
        assert grammar("auto", True, text), text


def test_required_constraint_is_one_object_unless_parallel(grammar):
    assert grammar("required", False, OBJ) and grammar("required", False, OBJ2)
    for text in (f"[{OBJ}]", f"[{OBJ}, {OBJ2}]", OBJ + OBJ2, "text"):
        assert not grammar("required", False, text), text
    assert grammar("required", True, f"[{OBJ}, {OBJ2}]") and not grammar("required", True, OBJ)


@pytest.mark.slow
def test_real_model_makes_exactly_one_call():
    from formwork import LLM, SamplingParams
    from formwork.gateway.chat import build_chat_prompt
    llm = LLM(dtype="float32", num_kv_blocks=128)

    def run(choice: str, parallel: bool):
        mode = _mode(choice, parallel)
        _, ids = build_chat_prompt(llm.tokenizer, [ChatCompletionRequest(
            messages=REPEAT).messages[0]], mode, None)
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(
            temperature=0, max_tokens=100, structured_outputs=tool_constraint(mode)),
            use_tqdm=False)[0].outputs[0]
        return mode, out

    mode, out = run("auto", True)       # the model copies both calls when it may
    assert out.text.count("<tool_call>") == 2 and len(parse_tool_output(mode, out.text)[1]) == 2
    mode, out = run("auto", False)
    assert out.finish_reason == "stop" and out.text.count("<tool_call>") == 1
    content, calls = parse_tool_output(mode, out.text)
    assert content is None and [c.function.name for c in calls] == ["get_weather"]
    mode, out = run("required", False)
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)
    assert len(parse_tool_output(mode, out.text)[1]) == 1
    llm.shutdown()

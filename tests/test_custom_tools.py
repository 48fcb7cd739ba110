"""OpenAI's custom tools (`{"type": "custom", "custom": {"name", "format"}}`: the
input is one string, free or under a Lark grammar or a regex), on chat completions
and the Responses API: how they are shown to the model and constrained per
tool_choice, calls parsed back (whole and streamed) in OpenAI's custom shape,
history turns, refusals naming the field, walks under the masks whose inputs all
belong to the grammar, and the real server through the openai SDK."""
from __future__ import annotations

import json
import random
import re

import openai
import pytest

from formwork.gateway.chat import render_messages
from formwork.gateway.errors import APIError
from formwork.gateway.output_check import check_output, lark_grammars, prepare_lark
from formwork.gateway.responses_input import (chat_request, chat_tool_choice, chat_tools,
                                              input_messages, responses_error)
from formwork.gateway.serving_responses import EventWriter, assistant_message, output_items
from formwork.gateway.tool_parser import ToolStreamParser, parse_tool_output
from formwork.gateway.tools import resolve_tool_mode, tool_constraint
from formwork.grammar.backend import allocate_bitmask, allowed_token_ids
from formwork.grammar.manager import build_backend
from formwork.grammar.vocab import TokenVocab
from formwork.schemas.openai import ChatCompletionRequest, ResponseMessage
from formwork.schemas.responses import CustomToolCallItem, ResponsesRequest

MSGS = [{"role": "user", "content": "hi"}]
# a regular language, so that the Lark tool's inputs can be checked with a regex
LARK = 'start: expr\nexpr: NUM OP NUM\nOP: "+" | "-" | "*"\nNUM: /[0-9]{1,4}/'
LARK_RE = re.compile(r"[0-9]{1,4}[+*-][0-9]{1,4}")
SQL_RE = "SELECT [a-z_]{1,12} FROM [a-z_]{1,12}( WHERE [a-z_]{1,12} = [0-9]{1,4})?"
CALC = {"type": "custom", "custom": {"name": "calc", "description": "Evaluate arithmetic",
                                     "format": {"type": "grammar",
                                                "grammar": {"syntax": "lark", "definition": LARK}}}}
SQL = {"type": "custom", "custom": {"name": "sql", "description": "Run a SQL query",
                                    "format": {"type": "grammar",
                                               "grammar": {"syntax": "regex", "definition": SQL_RE}}}}
NOTE = {"type": "custom", "custom": {"name": "note"}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"], "additionalProperties": False}}}


def _mode(tools, choice=None, parallel=True):
    return resolve_tool_mode(ChatCompletionRequest(messages=MSGS, tools=tools, tool_choice=choice,
                                                   parallel_tool_calls=parallel))


def _refusal(tools, choice=None) -> APIError:
    with pytest.raises(APIError) as e:
        _mode(tools, choice)
    assert e.value.status == 400
    return e.value


def named(name: str) -> dict:
    return {"type": "custom", "custom": {"name": name}}


# ---- shown as, constrained as --------------------------------------------------------------

def test_a_custom_tool_is_shown_as_a_function_with_one_string_argument():
    mode = _mode([SQL, NOTE, WEATHER], "auto")
    sql, note, weather = mode.tools
    assert sql.parameters == {"type": "object", "properties": {"input": {
        "type": "string", "pattern": f"^(?:{SQL_RE})$"}}, "required": ["input"],
        "additionalProperties": False}
    assert note.parameters["properties"] == {"input": {"type": "string"}}
    assert "Run a SQL query" in sql.description and SQL_RE in sql.description
    assert weather.parameters == WEATHER["function"]["parameters"]
    assert mode.custom == {"sql": mode.custom["sql"], "note": None}
    prompt = render_messages(ChatCompletionRequest(messages=MSGS).messages, mode, False)[0]
    assert '"name": "sql"' in prompt["content"] and '"input"' in prompt["content"]


def test_named_custom_tool_constrains_the_output_to_its_input():
    sql = tool_constraint(_mode([SQL, WEATHER], named("sql")))
    assert sql.regex == SQL_RE and sql.backend == "auto"
    calc = tool_constraint(_mode([CALC], named("calc")))
    assert calc.grammar == LARK and calc.backend == "llguidance"     # Lark is its language
    assert tool_constraint(_mode([NOTE], named("note"))) is None     # free text
    text = {"type": "custom", "custom": {"name": "t", "format": {        # type says text
        "type": "text", "grammar": {"syntax": "regex", "definition": "a"}}}}
    assert tool_constraint(_mode([text], named("t"))) is None


def test_tool_choice_names_a_tool_by_its_unique_name():
    err = _refusal([SQL, WEATHER], named("nowhere"))
    assert err.param == "tool_choice" and "'nowhere'" in err.message and "sql" in err.message
    # a name picks its tool whatever type the reference says: LangChain names a custom
    # tool as {"type": "function", ...} (tool_choice="sql" on its Responses path)
    assert tool_constraint(_mode([SQL], {"type": "function", "function": {"name": "sql"}})) \
        == tool_constraint(_mode([SQL], named("sql")))
    assert _mode([SQL, WEATHER], named("get_weather")).name == "get_weather"
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "custom", "custom": {"name": "sql"}}]}}
    mode = _mode([SQL, WEATHER], allowed)
    assert [t.name for t in mode.tools] == ["sql"] and len(mode.prompt_tools) == 2
    allowed["allowed_tools"]["tools"] = [{"type": "custom", "custom": {"name": "nowhere"}}]
    assert _refusal([SQL, WEATHER], allowed).param == "tool_choice.allowed_tools.tools"
    err = _refusal([SQL, {"type": "function", "function": {"name": "sql"}}])
    assert err.param == "tools"                                       # names are unique


def test_a_lark_tool_without_tags_to_carry_its_input_is_refused_naming_its_format():
    """Llama 3's calls are bare JSON (no closing tag to end a raw input): a Lark tool
    callable there is a 400; named, or not callable, it is served."""
    from formwork.gateway.tools import LLAMA3_JSON

    def llama(choice):
        return resolve_tool_mode(ChatCompletionRequest(messages=MSGS, tools=[WEATHER, CALC],
                                                       tool_choice=choice), LLAMA3_JSON)
    for choice in (None, "auto", "required"):
        with pytest.raises(APIError) as e:
            llama(choice)
        assert e.value.param == "tools[1].custom.format" and "llama3_json" in e.value.message
    for ok in ("none", named("calc"), {"type": "allowed_tools", "allowed_tools": {
            "mode": "required", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}):
        llama(ok)
    # Hermes tags carry it in every mode
    for choice in (None, "auto", "required", "none", named("calc")):
        _mode([WEATHER, CALC], choice)


def test_required_with_a_lark_tool_is_tagged_calls_and_nothing_else():
    mode = _mode([CALC, WEATHER], "required", parallel=True)
    assert mode.tagged and not _mode([SQL, WEATHER], "required").tagged
    so = tool_constraint(mode)
    assert so.backend == "llguidance" and so.structural_tag["format"]["at_least_one"]
    text = ('<tool_call>\n{"name": "calc"}\n1+2\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    content, calls = parse_tool_output(mode, text)
    assert content is None and [c.name for c in calls] == ["calc", "get_weather"]
    parser = ToolStreamParser(mode)
    assert parser.feed(text)[1] == [] and [d.index for d in parser.finish()[1]] == [0, 1]


def test_a_lark_tools_call_carries_its_input_raw_between_the_tags():
    """Under tool_choice auto a Lark tool's input is written as it is (a Lark grammar
    cannot constrain a JSON string): taught by the tools prompt, rendered so in the
    history, parsed back whole and streamed."""
    mode = _mode([CALC, WEATHER], "auto")
    assert mode.raw == {"calc"}
    so = tool_constraint(mode)
    assert so.backend == "llguidance"                  # the tag's content is Lark
    tag = so.structural_tag["format"]["tags"][0]
    assert tag["begin"] == '<tool_call>\n{"name": "calc"}\n' and tag["end"] == "\n</tool_call>"
    assert tag["content"] == {"type": "lark", "grammar": LARK}
    text = 'Let me compute.\n<tool_call>\n{"name": "calc"}\n12*7\n</tool_call>'
    content, calls = parse_tool_output(mode, text)
    assert content == "Let me compute." and calls[0].custom.model_dump() == {
        "name": "calc", "input": "12*7"}
    for step in (1, 4, 9):
        parser = ToolStreamParser(mode)
        got = [d for i in range(0, len(text), step) for d in parser.feed(text[i:i + step])[1]]
        assert [d.custom.input for d in got] == ["12*7"] and got[0].type == "custom"
    msgs = ChatCompletionRequest(messages=MSGS + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "custom", "custom": {"name": "calc", "input": "12*7"}}]}]).messages
    rendered = render_messages(msgs, mode, native_tools=False)
    assert rendered[2]["content"] == '<tool_call>\n{"name": "calc"}\n12*7\n</tool_call>'
    assert 'Call calc with its input as it is' in rendered[0]["content"]
    # a template that knows tools would show the call as JSON arguments: it gets the raw
    # spelling in the content instead, as the grammar makes the model write it
    native = render_messages(msgs, mode, native_tools=True)
    assert "tool_calls" not in native[1] and native[1]["content"] == rendered[2]["content"]
    assert parse_tool_output(mode, rendered[2]["content"])[1][0].custom.input == "12*7"
    # re-checked after the fact against its grammar (llguidance over the bytes), once
    # the server prepared the grammar's parser (before the request ran, off the loop)
    assert lark_grammars(so, mode) == [LARK]
    prepare_lark(lark_grammars(so, mode))
    assert check_output(so, mode, text, "stop", None).valid is True
    bad = check_output(so, mode, text.replace("12*7", "12**7"), "stop", None)
    assert bad.valid is False and "tool_calls[0] (calc) input: does not follow" in bad.error


def test_lark_outputs_are_rechecked_byte_by_byte():
    """A named Lark tool's output (and any Lark `grammar` constraint) gets a verdict
    from llguidance's parser over its bytes; a failed check leaves nothing behind for
    the next one; an EBNF grammar (xgrammar's dialect) stays unchecked."""
    from formwork.schemas.structured import StructuredOutputsParams
    so = tool_constraint(_mode([CALC], named("calc")))
    mode = _mode([CALC], named("calc"))
    # never compiled on the event loop: a grammar the server did not prepare is unchecked
    unprepared = StructuredOutputsParams(grammar='start: "z"+')
    assert check_output(unprepared, None, "zz", "stop", None).valid is None
    prepare_lark(lark_grammars(unprepared, None))
    assert check_output(unprepared, None, "zz", "stop", None).valid is True
    assert lark_grammars(so, mode) == [LARK]
    prepare_lark(lark_grammars(so, mode))
    for text, valid in (("12*7", True), ("12**7", False), ("12*", False), ("12*7", True),
                        ("9999-0", True), ("", False)):
        assert check_output(so, mode, text, "stop", None).valid is valid, text
    cut = check_output(so, mode, "12*", "length", None)
    assert cut.error == "cut by max_tokens (finish_reason length): ends before the grammar allows"
    ebnf = StructuredOutputsParams(grammar='root ::= "a" | "b"')
    assert check_output(ebnf, None, "c", "stop", None).valid is None
    # special tokens (by name or id) are left out of the text: unchecked, never "invalid"
    for g in ('start: <|im_start|> "a"', 'start: "a" <[1]>'):
        named_tokens = StructuredOutputsParams(grammar=g)
        prepare_lark(lark_grammars(named_tokens, None))
        assert check_output(named_tokens, None, "a", "stop", None).valid is None, g


@pytest.mark.parametrize("choice,answer", [("auto", None), ("required", None), ("auto", {
    "type": "object", "properties": {"result": {"type": "integer"}}, "required": ["result"],
    "additionalProperties": False})])
def test_walks_into_a_raw_lark_call_parse_back_in_its_language(tokenizer, vocab, choice, answer):
    """Random walks under tool_choice auto's mask (and auto beside a response_format:
    the answer or the calls; and required: the calls alone), entering a call: every
    finished output's calls parse back, a Lark tool's input in its grammar's
    language, a function's arguments valid."""
    from formwork.gateway.params import structured_from_request
    req = ChatCompletionRequest(messages=MSGS, tools=[CALC, WEATHER], parallel_tool_calls=False,
                                tool_choice=choice,
                                response_format=None if answer is None else {
                                    "type": "json_schema", "json_schema": {"name": "a",
                                                                           "schema": answer}})
    mode = resolve_tool_mode(req)
    so, _ = structured_from_request(req, mode)
    compiled = build_backend("llguidance", vocab, tokenizer).compile(so)
    rng, seen = random.Random(3), {"calc": 0, "get_weather": 0}
    prefix = tokenizer.encode(("Sure. " if choice == "auto" and answer is None else "")
                              + "<tool_call>", add_special_tokens=False)
    for _ in range(24):
        text = _walk(compiled, vocab, len(tokenizer), rng, prefix, steps=80, stop=0.5, short=True)
        if text is None:
            continue
        _, calls = parse_tool_output(mode, text)
        assert len(calls) == 1, text
        if calls[0].type == "custom":
            assert calls[0].custom.name == "calc" and LARK_RE.fullmatch(calls[0].custom.input)
        else:
            assert calls[0].function.name == "get_weather"
            assert len(json.loads(calls[0].function.arguments)["city"]) <= 20
        seen[calls[0].name] += 1
    assert seen["calc"] >= 3 and seen["get_weather"] >= 1, seen


def test_the_flat_responses_spelling_is_taken_on_chat_too():
    """LangChain's `custom_tool` sends the Responses API's flat tool to chat completions."""
    flat = {"type": "custom", "name": "calc", "description": "Evaluate arithmetic",
            "format": {"type": "grammar", "syntax": "lark", "definition": LARK}}
    assert ChatCompletionRequest(messages=MSGS, tools=[flat]).tools == \
        ChatCompletionRequest(messages=MSGS, tools=[CALC]).tools


@pytest.mark.parametrize("bad,param", [
    ({"type": "custom", "custom": {"name": "x", "format": {"type": "grammar"}}},
     "tools[0].custom.format"),
    ({"type": "custom", "custom": {"name": "x", "format": {
        "type": "grammar", "grammar": {"syntax": "pcre", "definition": "a"}}}},
     "tools[0].custom.format.grammar.syntax"),
    ({"type": "custom"}, "tools[0].custom"),
])
def test_malformed_custom_tools_name_the_field(bad, param):
    from formwork.gateway.errors import describe_validation_errors
    from pydantic import ValidationError
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest(messages=MSGS, tools=[bad])
    assert describe_validation_errors(e.value.errors())[0] == param


# ---- calls back ----------------------------------------------------------------------------

def test_calls_come_back_in_the_custom_shape():
    mode = _mode([SQL, NOTE, WEATHER], "required")
    text = ('[{"name": "sql", "arguments": {"input": "SELECT a FROM b"}}, '
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    content, calls = parse_tool_output(mode, text)
    assert content is None
    dumped = ResponseMessage(tool_calls=calls).model_dump(mode="json")["tool_calls"]
    assert dumped[0] == {"id": calls[0].id, "type": "custom",
                         "custom": {"name": "sql", "input": "SELECT a FROM b"}}
    assert dumped[1] == {"id": calls[1].id, "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}       # no "custom": null
    auto = _mode([SQL, NOTE], "auto")
    content, calls = parse_tool_output(auto, 'Sure.\n<tool_call>\n{"name": "note", "arguments": '
                                             '{"input": "a \\"quoted\\"\\nline"}}\n</tool_call>')
    assert content == "Sure." and calls[0].custom.input == 'a "quoted"\nline'
    _, calls = parse_tool_output(_mode([SQL], named("sql")), "SELECT a FROM b")
    assert calls[0].type == "custom" and calls[0].custom.input == "SELECT a FROM b"


@pytest.mark.parametrize("seed", range(4))
def test_streamed_custom_calls_add_up_to_the_whole(seed):
    rng = random.Random(seed)
    text = "SELECT users FROM accounts WHERE id = 42"
    cuts = sorted(rng.sample(range(1, len(text)), 6))
    pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
    parser = ToolStreamParser(_mode([SQL], named("sql")))
    deltas = [d for p in pieces for d in parser.feed(p)[1]] + parser.finish()[1]
    assert deltas[0].type == "custom" and deltas[0].custom.name == "sql" and deltas[0].id
    assert all(d.index == 0 and d.function is None for d in deltas)
    assert "".join(d.custom.input for d in deltas) == text
    # auto: a whole call once its closing tag is out
    auto = ToolStreamParser(_mode([SQL, NOTE], "auto"))
    call = '<tool_call>\n{"name": "note", "arguments": {"input": "buy milk"}}\n</tool_call>'
    got = [d for i in range(0, len(call), 7) for d in auto.feed(call[i:i + 7])[1]]
    assert len(got) == 1 and got[0].type == "custom"
    assert got[0].custom.model_dump() == {"name": "note", "input": "buy milk"}


def test_history_custom_calls_render_as_the_function_they_were_written_as():
    msgs = ChatCompletionRequest(messages=MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "custom", "custom": {"name": "sql", "input": "SELECT a FROM b"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 rows"}]).messages
    mode = _mode([SQL], "auto")
    spelled = render_messages(msgs, mode, native_tools=False)
    assert spelled[2]["content"] == ('<tool_call>\n{"name": "sql", "arguments": {"input": '
                                     '"SELECT a FROM b"}}\n</tool_call>')
    # what the history shows parses back to the same call
    assert parse_tool_output(mode, spelled[2]["content"])[1][0].custom.input == "SELECT a FROM b"
    native = render_messages(msgs, mode, native_tools=True)
    assert native[1]["tool_calls"] == [{"id": "c1", "type": "function", "function": {
        "name": "sql", "arguments": {"input": "SELECT a FROM b"}}}]
    with pytest.raises(Exception) as e:
        ChatCompletionRequest(messages=MSGS + [{"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "custom", "function": {"name": "sql", "arguments": "{}"}}]}])
    assert "custom" in str(e.value)


def test_the_output_check_holds_a_custom_input_to_its_regex():
    mode = _mode([SQL, NOTE], "auto")
    so = tool_constraint(mode)

    def verdict(sql: str):
        text = ('<tool_call>\n{"name": "sql", "arguments": ' + json.dumps({"input": sql})
                + '}\n</tool_call>')
        return check_output(so, mode, text, "stop", None)
    assert verdict("SELECT a FROM b").valid is True
    bad = verdict("DROP TABLE b")
    assert bad.valid is False and "input" in bad.error


# ---- masks ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vocab(tokenizer):
    return TokenVocab.from_tokenizer(tokenizer, len(tokenizer))


def _walk(compiled, vocab, size: int, rng, prefix: list[int], steps: int, stop: float,
          short: bool = False) -> str | None:
    """A random walk under the mask after `prefix` (accepted first): the text once the
    end of sequence is taken (with probability `stop` where allowed, always where it is
    the only token), None after `steps` tokens without it. `short`: prefer tokens of at
    most two bytes (walks that close). No special token but the end is ever allowed."""
    m, bm, out = compiled.new_matcher(), allocate_bitmask(1, size), list(prefix)
    assert m.accept_tokens(out)
    for _ in range(steps):
        m.fill_bitmask(bm, 0)
        allowed = allowed_token_ids(bm, 0, size)
        assert allowed and all(vocab.token_bytes[t] is not None for t in allowed
                               if t != vocab.eos_token_id)
        if vocab.eos_token_id in allowed and (rng.random() < stop or len(allowed) == 1):
            return b"".join(vocab.token_bytes[t] for t in out).decode()
        choices = [t for t in allowed if t != vocab.eos_token_id]
        if short:
            choices = [t for t in choices if len(vocab.token_bytes[t]) <= 2] or choices
        t = rng.choice(choices)
        assert m.accept_tokens([t])
        out.append(t)
    return None


def _accepts(compiled, tokenizer, vocab, text: str) -> bool:
    m = compiled.new_matcher()
    return (m.accept_tokens(tokenizer.encode(text, add_special_tokens=False))
            and m.accept_tokens([vocab.eos_token_id]) and m.is_terminated())


def test_the_regex_holds_inside_a_json_call(tokenizer, vocab):
    """tool_choice required / auto: the input is a JSON string under the regex, on
    llguidance (xgrammar compiles a JSON string's pattern loosely: it refuses it, so
    `auto` never picks it here)."""
    from formwork.grammar.schema_check import UnsupportedSchemaError
    with pytest.raises(UnsupportedSchemaError, match="pattern"):
        build_backend("xgrammar", vocab, tokenizer).compile(
            tool_constraint(_mode([SQL], "required")))
    backend = build_backend("llguidance", vocab, tokenizer)
    required = backend.compile(tool_constraint(_mode([SQL, NOTE], "required", parallel=False)))
    call = '{"name": "sql", "arguments": {"input": %s}}'
    assert _accepts(required, tokenizer, vocab, call % '"SELECT a FROM b WHERE id = 3"')
    for bad in ('"DROP TABLE b"', '"SELECT a FROM b;"', '"select a from b"'):
        assert not _accepts(required, tokenizer, vocab, call % bad), bad
    assert _accepts(required, tokenizer, vocab,
                    '{"name": "note", "arguments": {"input": "anything \\"at\\" all"}}')
    auto = backend.compile(tool_constraint(_mode([SQL], "auto")))
    tag = '<tool_call>\n{"name": "sql", "arguments": {"input": %s}}\n</tool_call>'
    assert _accepts(auto, tokenizer, vocab, "Sure. " + tag % '"SELECT a FROM b"')
    assert not _accepts(auto, tokenizer, vocab, "Sure. " + tag % '"SELECT * FROM b"')


@pytest.mark.parametrize("tool,check", [(CALC, LARK_RE), (SQL, re.compile(SQL_RE))])
def test_walks_under_a_named_custom_tool_stay_in_its_language(tokenizer, vocab, tool, check):
    """Random walks under the named tool's mask (the backend `auto` picks, Lark on
    llguidance): every finished input belongs to the grammar; no special token but
    the end of sequence is ever allowed."""
    so = tool_constraint(_mode([tool], named(tool["custom"]["name"])))
    backend = build_backend(so.backend if so.backend != "auto" else "llguidance", vocab, tokenizer)
    compiled, rng, finished = backend.compile(so), random.Random(11), 0
    for _ in range(16):
        text = _walk(compiled, vocab, len(tokenizer), rng, [], steps=60, stop=0.3)
        if text is None:
            continue
        finished += 1
        assert check.fullmatch(text), text
    assert finished >= 8


# ---- the Responses API ----------------------------------------------------------------------

RESP_CALC = {"type": "custom", "name": "calc", "description": "Evaluate arithmetic",
             "format": {"type": "grammar", "syntax": "lark", "definition": LARK}}


def test_responses_custom_tools_map_to_the_chat_request():
    assert chat_tools([RESP_CALC]) == [CALC]
    assert chat_tools([{"type": "custom", "name": "note"}]) == [NOTE]
    assert chat_tool_choice({"type": "custom", "name": "calc"}) == named("calc")
    msgs = input_messages([
        {"role": "user", "content": "12*7?"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "calc", "input": "12*7"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "84"}])
    assert msgs[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "custom", "custom": {"name": "calc", "input": "12*7"}}]}
    assert msgs[2] == {"role": "tool", "tool_call_id": "c1", "content": "84"}
    req = ResponsesRequest(model="m", input="x", tools=[RESP_CALC],
                           tool_choice={"type": "custom", "name": "calc"})
    assert tool_constraint(resolve_tool_mode(chat_request(req, msgs))).grammar == LARK


@pytest.mark.parametrize("tool,param", [
    ({"type": "custom", "name": "x", "format": {"type": "grammar", "syntax": "pcre",
                                                "definition": "a"}}, "tools[0].format.syntax"),
    ({"type": "custom", "name": "x", "format": {"type": "grammar", "syntax": "regex"}},
     "tools[0].format.definition"),
])
def test_responses_refusals_name_the_flat_fields(tool, param):
    req = ResponsesRequest(model="m", input="x", tools=[tool])
    with pytest.raises(APIError) as e:
        chat_request(req, input_messages("x"))
    assert e.value.param == param and e.value.message.startswith(param)
    lark = APIError(400, "tools[0].custom.format: a Lark grammar ...",
                    param="tools[0].custom.format")
    assert responses_error(lark).param == "tools[0].format"


def test_responses_output_items_and_events_of_a_custom_call():
    mode = _mode([SQL], named("sql"))
    _, calls = parse_tool_output(mode, "SELECT a FROM b")
    items = output_items(None, calls, cut=False)
    assert len(items) == 1 and isinstance(items[0], CustomToolCallItem)
    assert items[0].model_dump(mode="json") | {"id": "x"} == {
        "id": "x", "type": "custom_tool_call", "call_id": calls[0].id, "name": "sql",
        "input": "SELECT a FROM b", "status": "completed"}
    assert assistant_message(items)["tool_calls"] == [
        {"id": calls[0].id, "type": "custom", "custom": {"name": "sql", "input": "SELECT a FROM b"}}]
    w, parser, events = EventWriter(), ToolStreamParser(mode), []
    for piece in ("SELECT a", " FROM", " b"):
        events += w.feed(*parser.feed(piece))
    events += w.close("completed")
    kinds = [json.loads(e.split("data: ", 1)[1])["type"] for e in events]
    assert kinds == ["response.output_item.added"] + ["response.custom_tool_call_input.delta"] * 3 \
        + ["response.custom_tool_call_input.done", "response.output_item.done"]
    done = json.loads(events[-2].split("data: ", 1)[1])
    assert done["input"] == "SELECT a FROM b" and w.items[0].input == "SELECT a FROM b"


# ---- the real server through the openai SDK ---------------------------------------------------

@pytest.fixture(scope="module")
def client():
    from test_server import small_server_client
    yield from small_server_client()


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


ASK = [{"role": "user", "content": "What is 12 times 7? Use the calculator."}]


@pytest.mark.slow
def test_server_named_custom_tools(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=[CALC, WEATHER],
                                       tool_choice=named("calc"), max_tokens=30, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert call.type == "custom" and call.custom.name == "calc"
    assert LARK_RE.fullmatch(call.custom.input), call.custom.input
    assert r.choices[0].model_extra["formwork"] == {"valid": True, "error": None}   # re-checked
    # streamed, the same input piece by piece
    pieces, finish = [], None
    for chunk in client.chat.completions.create(
            model=model, messages=ASK, tools=[CALC, WEATHER], tool_choice=named("calc"),
            max_tokens=30, temperature=0, stream=True):
        for ch in chunk.choices:
            pieces += [t.model_dump(exclude_none=True) for t in ch.delta.tool_calls or ()]
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and pieces[0]["type"] == "custom" and pieces[0]["id"]
    assert "".join(p["custom"]["input"] for p in pieces) == call.custom.input
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Users with id 3?"}],
        tools=[SQL, NOTE, WEATHER], tool_choice=named("sql"), max_tokens=40)
    assert re.fullmatch(SQL_RE, r.choices[0].message.tool_calls[0].custom.input)


@pytest.mark.slow
def test_server_required_calls_and_history(client, model):
    for seed in range(3):
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Show the users table."}],
            tools=[SQL, WEATHER], tool_choice="required", max_tokens=96, seed=seed,
            temperature=1.0)
        calls = r.choices[0].message.tool_calls
        assert calls, r.choices[0].message.content
        for call in calls:
            if call.type == "custom":
                assert re.fullmatch(SQL_RE, call.custom.input), call.custom.input
            else:
                assert call.function.name == "get_weather"
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "custom", "custom": {"name": "calc", "input": "12*7"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "84"}]
    r = client.chat.completions.create(model=model, messages=history, tools=[CALC],
                                       tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None
    # a Lark tool beside others: its call carries the input raw between the tags
    # (required forces a call; auto, the default, is the same language after free text)
    for seed in range(3):
        r = client.chat.completions.create(model=model, messages=ASK, tools=[CALC, WEATHER],
                                           tool_choice="required", max_tokens=48, seed=seed,
                                           temperature=1.0)
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].message.content is None
        for call in calls:
            assert call.type == "function" or LARK_RE.fullmatch(call.custom.input), call
    r = client.chat.completions.create(model=model, messages=ASK, tools=[CALC, WEATHER],
                                       max_tokens=24)
    for call in r.choices[0].message.tool_calls or ():
        assert call.type == "function" or LARK_RE.fullmatch(call.custom.input)
    bad = {"type": "custom", "custom": {"name": "x", "format": {
        "type": "grammar", "grammar": {"syntax": "lark", "definition": "start: nowhere"}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, tools=[bad],
                                       tool_choice=named("x"), max_tokens=4)
    assert e.value.body["param"] == "tools[0].custom.format.grammar.definition"


@pytest.mark.slow
def test_server_responses_custom_tool_calls(client, model):
    r = client.responses.create(model=model, input="What is 12 times 7?", tools=[RESP_CALC],
                                tool_choice={"type": "custom", "name": "calc"},
                                max_output_tokens=30, temperature=0)
    item = r.output[-1]
    assert r.status == "completed" and item.type == "custom_tool_call" and item.name == "calc"
    assert LARK_RE.fullmatch(item.input), item.input
    follow = client.responses.create(
        model=model, previous_response_id=r.id, tools=[RESP_CALC], tool_choice="none",
        input=[{"type": "custom_tool_call_output", "call_id": item.call_id, "output": "84"}],
        max_output_tokens=8)
    assert follow.output[0].type == "message"
    events, deltas = [], []
    with client.responses.stream(model=model, input="What is 12 times 7?", tools=[RESP_CALC],
                                 tool_choice={"type": "custom", "name": "calc"},
                                 max_output_tokens=30, temperature=0) as stream:
        for e in stream:
            events.append(e.type)
            if e.type == "response.custom_tool_call_input.delta":
                deltas.append(e.delta)
        final = stream.get_final_response()
    assert "response.custom_tool_call_input.done" in events
    assert "".join(deltas) == final.output[-1].input == item.input
    r = client.responses.create(model=model, input="What is 12 times 7?", tools=[RESP_CALC],
                                tool_choice="required", max_output_tokens=48)
    assert [i.type for i in r.output] == ["custom_tool_call"] and LARK_RE.fullmatch(r.output[0].input)

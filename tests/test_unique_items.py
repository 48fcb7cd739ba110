"""`uniqueItems` on arrays of free strings / integers, kept while decoding
(grammar/unique_items.py): which sites are served, the mask and accept_tokens
refuse every duplicate (as `jsonschema` compares items), rollback, and random
walks that chase duplicates all end in outputs `jsonschema` accepts."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from enum import Enum
from typing import Literal

from pydantic import BaseModel, Field

from formwork.grammar import unique_items, unique_items_matcher
from formwork.grammar.backend import allocate_bitmask, allowed_token_ids
from formwork.grammar.manager import build_backend
from formwork.grammar.schema_check import UnsupportedSchemaError
from formwork.grammar.selection import choose_backend
from formwork.grammar.vocab import TokenVocab
from formwork.schemas.structured import StructuredOutputsParams as P

VOCAB = 49152
STR_SET = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
INT_SET = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Inner(BaseModel):
    labels: set[str] = Field(max_length=4)


class Record(BaseModel):
    tags: set[str]
    ids: frozenset[int]
    maybe: set[str] | None = None
    inner: Inner
    groups: list[set[int]] = []
    by_name: dict[str, set[str]] = {}
    colors: set[Color] = set()
    sizes: set[Literal["S", "M", "L"]] = Field(default=set(), min_length=1)


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return TokenVocab.from_tokenizer(tokenizer, VOCAB)


@pytest.fixture(scope="module")
def backend(tokenizer, vocab):
    return build_backend("llguidance", vocab, tokenizer)


def _accepts(compiled, tokenizer, vocab, text: str) -> bool:
    m = compiled.new_matcher()
    return m.accept_tokens(tokenizer.encode(text, add_special_tokens=False)) \
        and m.accept_tokens([vocab.eos_token_id]) and m.is_terminated()


# -- which sites are served -------------------------------------------------------

def _served_paths(schema) -> int:
    return len(unique_items.plan(schema).sites)


def test_pydantic_sets_are_served_everywhere_a_position_tells_the_node():
    schema = Record.model_json_schema()
    plan = unique_items.plan(schema)
    # tags, ids, maybe (Optional: anyOf array|null), Inner.labels ($defs), the
    # list's items, the dict's values, the two enum sets
    assert len(plan.sites) == 8
    assert sorted(k for k, _, _ in plan.sites.values()).count("e") == 2
    assert '"uniqueItems"' not in json.dumps(plan.schema)
    assert '"uniqueItems"' in json.dumps(schema)          # the input is not mutated
    assert choose_backend(P(json=schema)) == "llguidance"


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True, "minItems": 3},
    {"type": "array", "items": {"enum": ["a", 1.5]}, "uniqueItems": True},
    {"type": "array", "items": {"enum": ["a", True]}, "uniqueItems": True},
    {"type": "array", "items": {"enum": ["é", "e"]}, "uniqueItems": True},
    {"type": "array", "items": {"type": "object"}, "uniqueItems": True},
    {"type": "array", "items": {"type": "string", "maxLength": 0}, "uniqueItems": True},
    {"type": "array", "items": {"type": "string", "pattern": "^a+$"}, "uniqueItems": True},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3},
     "uniqueItems": True},
    {"type": "array", "items": {"type": "number"}, "uniqueItems": True},
    {"type": "array", "items": {"type": "integer", "minimum": -2}, "uniqueItems": True},  # -1 ends
    {"type": "array", "items": {"type": "integer", "maximum": 9}, "uniqueItems": True},   # 9 ends
    {"type": "array", "uniqueItems": True},                                      # any items
    {"anyOf": [STR_SET, {"type": "array", "items": {"type": "integer"}}]},       # which array?
    {"type": "object", "properties": {"t": STR_SET}, "patternProperties": {"^x": STR_SET}},
    {"type": "array", "prefixItems": [STR_SET]},
    {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "contains": {"const": "a"}},
])
def test_sites_a_position_cannot_tell_or_that_can_run_out_stay_refused(backend, schema):
    plan = unique_items.plan(schema)
    assert all(id(n) for n in plan.sites)       # whatever is served is not the refused one
    with pytest.raises(UnsupportedSchemaError, match="uniqueItems"):
        backend.compile(P(json=schema))


def test_annotations_and_nullable_arrays_do_not_stop_a_site():
    schema = {"type": "object", "properties": {"t": {
        "type": ["array", "null"], "$id": "x", "markdownDescription": "d", "x-taplo": {},
        "items": {"type": "string", "title": "t"}, "uniqueItems": True}}}
    assert _served_paths(schema) == 1


def test_a_node_reached_both_ways_is_refused(backend):
    shared = {"$defs": {"S": STR_SET}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/S"},
                             "b": {"anyOf": [{"$ref": "#/$defs/S"}, {"type": "integer"},
                                             {"type": "array", "items": {"type": "integer"}}]}}}
    assert _served_paths(shared) == 0
    with pytest.raises(UnsupportedSchemaError, match="uniqueItems"):
        backend.compile(P(json=shared))


def _call(name: str, arguments: dict) -> dict:     # as gateway/tools.py writes a tool call
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


TOOLS = {"anyOf": [
    _call("tag", {"type": "object", "properties": {"tags": STR_SET}, "required": ["tags"]}),
    _call("pick", {"type": "object", "properties": {"ids": INT_SET, "tags": dict(STR_SET)}}),
]}


def test_tool_calls_told_apart_by_name_are_served(backend, tokenizer, vocab):
    """`tool_choice: required` with several tools: anyOf of calls, the name first."""
    for schema in (TOOLS, {"type": "array", "items": TOOLS, "minItems": 1}):   # parallel calls
        assert _served_paths(schema) == 3
        compiled = backend.compile(P(json=schema))
        wrap = (lambda t: "[" + t + "]") if schema is not TOOLS else (lambda t: t)
        for text, ok in [('{"name":"tag","arguments":{"tags":["a","b"]}}', True),
                         ('{"name":"tag","arguments":{"tags":["a","a"]}}', False),
                         ('{"name":"pick","arguments":{"ids":[3,4],"tags":["x"]}}', True),
                         ('{"name":"pick","arguments":{"ids":[3,3]}}', False)]:
            assert _accepts(compiled, tokenizer, vocab, wrap(text)) == ok, text
    plan = unique_items.plan(TOOLS)
    st = unique_items.step(plan, unique_items._State(), b'{"')
    with pytest.raises(unique_items.Duplicate):      # no member before the name
        unique_items.step(plan, st, b'arguments"')
    assert unique_items._stuck(unique_items.step(plan, st, b'arg'))
    assert not unique_items._stuck(unique_items.step(plan, st, b'na'))


def _auto_tools():
    """tool_choice "auto" with two tools, as the server builds it: free text in which
    `<tool_call>` starts a call (a structural tag)."""
    from formwork.gateway.tools import ToolMode, tool_constraint
    from formwork.schemas.openai import FunctionDefinition

    fns = (FunctionDefinition(name="tag", parameters={
               "type": "object", "properties": {"tags": STR_SET}, "required": ["tags"]}),
           FunctionDefinition(name="pick", parameters={
               "type": "object", "properties": {"ids": INT_SET, "note": {"type": "string"}}}))
    return tool_constraint(ToolMode("auto", fns))


def _calls(*calls: str) -> str:
    return "".join(f'<tool_call>\n{{"name": "{c.split(":", 1)[0]}", "arguments": '
                   f'{c.split(":", 1)[1]}}}\n</tool_call>\n' for c in calls)


@pytest.mark.parametrize("text, ok", [
    ("Sure. " + _calls('tag:{"tags": ["a", "b"]}'), True),
    ("Sure. " + _calls('tag:{"tags": ["a", "a"]}'), False),
    (_calls('pick:{"ids": [1, 2], "note": "[1, 1]"}'), True),     # a string, not an array
    (_calls('pick:{"ids": [1, 2, 1]}'), False),
    (_calls('tag:{"tags": ["x"]}', 'tag:{"tags": ["x"]}'), True),  # each call its own array
    (_calls('tag:{"tags": ["x"]}', 'pick:{"ids": [4, 4]}'), False),
    ('Plain text with "a", "a" and [1, 1] in it.', True),          # free text is free
])
def test_tool_calls_under_tool_choice_auto(backend, tokenizer, vocab, text, ok):
    """Under tool_choice "auto" each call's arguments keep their sets: the wrapper
    follows the JSON after each tag's begin, and the text between calls is free."""
    params = _auto_tools()
    assert choose_backend(params) == "llguidance"       # xgrammar would drop uniqueItems
    compiled = backend.compile(params)
    assert isinstance(compiled, unique_items_matcher.UniqueItemsCompiled)
    assert _accepts(compiled, tokenizer, vocab, text) == ok


def test_tool_call_masks_under_tool_choice_auto(backend, tokenizer, vocab):
    compiled = backend.compile(_auto_tools())
    m = compiled.new_matcher()
    assert m.accept_tokens(tokenizer.encode(
        'Ok <tool_call>\n{"name": "tag", "arguments": {"tags": ["ab", "ab',
        add_special_tokens=False))
    mask = allocate_bitmask(1, VOCAB)
    m.fill_bitmask(mask, 0)
    allowed = allowed_token_ids(mask, 0, VOCAB)
    assert allowed
    assert not [t for t in allowed if vocab.token_bytes[t].startswith(b'"')]   # "ab" again
    assert [t for t in allowed if vocab.token_bytes[t].startswith(b"c")]       # "abc" is new
    for t in allowed[:200]:
        assert m.accepts(t)


def test_unions_a_name_cannot_tell_apart_stay_refused(backend):
    same = {"anyOf": [_call("a", {"type": "object", "properties": {"t": STR_SET}}),
                      _call("a", {"type": "object"})]}
    late = {"anyOf": [{"type": "object", "properties": {"arguments": STR_SET, "name": {"const": "a"}},
                       "required": ["name"]},
                      {"type": "object", "properties": {"arguments": {}, "name": {"const": "b"}},
                       "required": ["name"]}]}
    for schema in (same, late):
        assert _served_paths(schema) == 0
        with pytest.raises(UnsupportedSchemaError, match="uniqueItems"):
            backend.compile(P(json=schema))


# -- exact texts ------------------------------------------------------------------

@pytest.mark.parametrize("text, ok", [
    ('{"tags":["a","b"],"ids":[1,2,3]}', True),
    ('{"tags":[],"ids":[10,1,100,-1]}', True),
    ('{"tags":["ab","a","abc",""],"ids":[]}', True),
    ('{"tags":["a","a"],"ids":[]}', False),
    ('{"tags":["a\\"b","a\\"b"],"ids":[]}', False),          # escaped, equal once decoded
    ('{"tags":["",""],"ids":[]}', False),
    ('{"tags":["x","y","x"],"ids":[]}', False),
    ('{"tags":[],"ids":[1,2,1]}', False),
    ('{"tags":[],"ids":[0,-0]}', False),                      # -0 == 0
    ('{"tags":[],"ids":[7,  7 ]}', False),
])
def test_duplicates_are_refused_and_the_rest_accepted(backend, tokenizer, vocab, text, ok):
    schema = {"type": "object", "properties": {"tags": STR_SET, "ids": INT_SET},
              "required": ["tags", "ids"]}
    compiled = backend.compile(P(json=schema))
    assert isinstance(compiled, unique_items_matcher.UniqueItemsCompiled)
    assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)) == ok
    assert _accepts(compiled, tokenizer, vocab, text) == ok


def test_a_string_at_its_max_length_that_repeats_an_item_is_never_reached(
        backend, tokenizer, vocab):
    schema = {"type": "array", "items": {"type": "string", "maxLength": 2}, "uniqueItems": True}
    compiled = backend.compile(P(json=schema))
    assert _accepts(compiled, tokenizer, vocab, '["ab","a","ba",""]')
    assert not _accepts(compiled, tokenizer, vocab, '["ab","ab"]')
    m = compiled.new_matcher()
    assert m.accept_tokens(tokenizer.encode('["ab","a', add_special_tokens=False))
    bm = allocate_bitmask(1, VOCAB)
    m.fill_bitmask(bm, 0)
    texts = {vocab.token_bytes[t] for t in allowed_token_ids(bm, 0, VOCAB)}
    assert b"c" in texts and b"b" not in texts and b'"' in texts    # "ab" taken, "a" not


@pytest.mark.parametrize("text, ok", [
    ('["red","green","blue"]', True),
    ('["blue","red"]', True),
    ('[]', True),
    ('["red","red"]', False),
    ('["red","green","red"]', False),
])
def test_enum_items(backend, tokenizer, vocab, text, ok):
    schema = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "uniqueItems": True}
    compiled = backend.compile(P(json=schema))
    assert _accepts(compiled, tokenizer, vocab, text) == ok


@pytest.mark.parametrize("text, ok", [
    ('[1,10,"1"]', True),
    ('[10,1]', True),
    ('[1,1]', False),
    ('["1","1"]', False),
    ('[10,"1",10]', False),
])
def test_integer_and_mixed_enum_items(backend, tokenizer, vocab, text, ok):
    schema = {"type": "array", "items": {"enum": [1, 10, "1"]}, "uniqueItems": True}
    compiled = backend.compile(P(json=schema))
    assert isinstance(compiled, unique_items_matcher.UniqueItemsCompiled)
    assert _accepts(compiled, tokenizer, vocab, text) == ok
    m = compiled.new_matcher()                      # 1 and 10 taken: no digit may start
    assert m.accept_tokens(tokenizer.encode('[1,10,', add_special_tokens=False))
    bm = allocate_bitmask(1, VOCAB)
    m.fill_bitmask(bm, 0)
    texts = {vocab.token_bytes[t] for t in allowed_token_ids(bm, 0, VOCAB)}
    assert b'"' in texts and b"1" not in texts


def test_enum_items_never_start_what_only_a_taken_value_can_finish(backend, tokenizer, vocab):
    schema = {"type": "array", "items": {"enum": ["red", "green", "grey"]}, "uniqueItems": True}
    m = backend.compile(P(json=schema)).new_matcher()
    bm = allocate_bitmask(1, VOCAB)
    assert m.accept_tokens(tokenizer.encode('["red","gr', add_special_tokens=False))
    assert m.accept_tokens(tokenizer.encode('een","', add_special_tokens=False))
    m.fill_bitmask(bm, 0)
    texts = {vocab.token_bytes[t] for t in allowed_token_ids(bm, 0, VOCAB)}
    assert b"g" in texts and b"r" not in texts          # only "grey" is left
    assert m.accept_tokens(tokenizer.encode('grey"', add_special_tokens=False))
    m.fill_bitmask(bm, 0)
    texts = {vocab.token_bytes[t] for t in allowed_token_ids(bm, 0, VOCAB)}
    assert b"]" in texts and not any(b"," in t for t in texts)   # all three taken


def test_escaped_keys_and_nested_values_are_followed(backend, tokenizer, vocab):
    schema = {"type": "object", "properties": {
        "a\"b": STR_SET, "skip": {"type": "object"}, "n": {"type": "array", "items": INT_SET}}}
    compiled = backend.compile(P(json=schema))
    assert len(compiled.scan.plan.sites) == 2
    assert _accepts(compiled, tokenizer, vocab, '{"a\\"b":["x","y"],"n":[[1,2],[1,2]]}')
    assert not _accepts(compiled, tokenizer, vocab, '{"a\\"b":["x","x"]}')
    assert not _accepts(compiled, tokenizer, vocab, '{"n":[[1,2],[3,3]]}')
    assert _accepts(compiled, tokenizer, vocab, '{"skip":{"q":[1,1]},"n":[[1],[1]]}')


def test_the_mask_forbids_every_token_that_would_repeat_an_item(backend, tokenizer, vocab):
    compiled = backend.compile(P(json={"type": "object", "properties": {"t": STR_SET}}))
    m = compiled.new_matcher()
    assert m.accept_tokens(tokenizer.encode('{"t":["ab","a', add_special_tokens=False))
    bm = allocate_bitmask(1, VOCAB)
    m.fill_bitmask(bm, 0)
    allowed = set(allowed_token_ids(bm, 0, VOCAB))
    texts = {vocab.token_bytes[t] for t in allowed}
    assert b"b" in texts and b"c" in texts               # "ab" again needs a "b" then a quote
    assert {b'"', b'",', b'"]', b'","'} <= texts          # "a" is new: it may close
    assert m.accept_tokens(tokenizer.encode('","a', add_special_tokens=False))
    m.fill_bitmask(bm, 0)
    allowed = set(allowed_token_ids(bm, 0, VOCAB))
    closers = [t for t in range(VOCAB) if vocab.token_bytes[t] and
               vocab.token_bytes[t].startswith(b'"') and t in allowed]
    assert closers == []                                # "a" is taken now
    # accepts() agrees with the mask on every token that could close the string
    for t in range(VOCAB):
        if vocab.token_bytes[t] and b'"' in vocab.token_bytes[t]:
            assert m.accepts(t) == (t in allowed), vocab.token_bytes[t]


def test_rollback_forgets_the_items_it_undoes(backend, tokenizer, vocab):
    compiled = backend.compile(P(json=INT_SET))
    m = compiled.new_matcher()
    ids = tokenizer.encode("[5,", add_special_tokens=False)
    assert m.accept_tokens(ids)
    five = tokenizer.encode("5", add_special_tokens=False)
    end = tokenizer.encode("]", add_special_tokens=False)
    assert m.accept_tokens(five) and not m.accept_tokens(end)     # [5,5] refused at its end
    m.rollback(len(five) + len(ids) - 1)                          # back to "["
    assert m.accept_tokens(five + end)                           # [5] is fine again
    m.reset()
    assert m.accept_tokens(tokenizer.encode("[5,6]", add_special_tokens=False))


class _Forced:
    """An inner matcher that forces a text (to test the jump-forward guard)."""

    def __init__(self, inner, forced):
        self.inner, self.forced = inner, forced

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def jump_forward_string(self):
        return self.forced


def test_jump_forward_never_writes_a_duplicate(backend, tokenizer, vocab):
    compiled = backend.compile(P(json=STR_SET))
    m = compiled.new_matcher()
    assert m.accept_tokens(tokenizer.encode('["x","', add_special_tokens=False))
    m.inner = _Forced(m.inner, 'x"')
    assert m.jump_forward_string() == ""
    m.inner = _Forced(m.inner.inner, 'xy"')
    assert m.jump_forward_string() == 'xy"'


def _walk(compiled, vocab, rng, steps=160, prefix: list[int] = ()) -> str | None:
    """Random walk that chases duplicates: it prefers tokens that close strings,
    end numbers and repeat short items; None if it did not finish. `prefix`:
    tokens accepted first (part of the text)."""
    m = compiled.new_matcher()
    bm = allocate_bitmask(1, VOCAB)
    out: list[int] = list(prefix)
    assert m.accept_tokens(out)
    chase = {b'"', b'",', b'"]', b'","', b'a', b'1', b'0', b',', b']', b'}', b'-'}
    for _ in range(steps):
        m.fill_bitmask(bm, 0)
        allowed = allowed_token_ids(bm, 0, VOCAB)
        assert allowed, "dead end"
        if vocab.eos_token_id in allowed and rng.random() < 0.3:
            assert m.accept_tokens([vocab.eos_token_id])
            return b"".join(vocab.token_bytes[t] for t in out).decode()
        pick = [t for t in allowed if vocab.token_bytes[t] in chase]
        t = rng.choice(pick if pick and rng.random() < 0.9 else allowed)
        assert m.accepts(t) and m.accept_tokens([t])
        if t == vocab.eos_token_id:
            return b"".join(vocab.token_bytes[t] for t in out).decode()
        out.append(t)
    return None


@pytest.mark.parametrize("schema", [
    STR_SET, INT_SET,
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "uniqueItems": True,
     "minItems": 6},
    {"type": "array", "items": {"type": "integer", "exclusiveMaximum": 0}, "uniqueItems": True,
     "minItems": 3},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "uniqueItems": True,
     "minItems": 4, "maxItems": 6},
    {"type": "array", "items": {"type": "string", "maxLength": 1}, "uniqueItems": True,
     "minItems": 6},
    Record.model_json_schema(),
    {"type": "array", "items": TOOLS, "minItems": 1},
    {"type": "array", "items": {"enum": ["a", "b", "ab", "ba"]}, "uniqueItems": True,
     "minItems": 4},
    {"type": "array", "items": {"type": "string", "enum": ["1", "0", "a"]}, "uniqueItems": True},
    {"type": "array", "items": {"enum": [1, 10, 0, -1, "1"]}, "uniqueItems": True, "minItems": 5},
])
def test_walks_chasing_duplicates_end_valid(backend, vocab, schema):
    compiled = backend.compile(P(json=schema))
    validator = jsonschema.Draft202012Validator(schema)
    rng = random.Random(7)
    finished = 0
    for _ in range(30):
        text = _walk(compiled, vocab, rng)
        if text is not None:
            finished += 1
            doc = json.loads(text)
            assert validator.is_valid(doc), (text, next(validator.iter_errors(doc)).message)
    assert finished >= 10


@pytest.mark.parametrize("tool", ["tag", "pick"])
def test_walks_into_auto_tool_calls_end_valid(backend, tokenizer, vocab, tool):
    """Walks that open a call under tool_choice "auto" and chase duplicates in its
    arguments: every finished output's calls validate against their tools' schemas."""
    params = _auto_tools()
    compiled = backend.compile(params)
    schemas = {"tag": {"type": "object", "properties": {"tags": STR_SET}, "required": ["tags"]},
               "pick": {"type": "object", "properties": {"ids": INT_SET, "note": {"type": "string"}}}}
    prefix = tokenizer.encode(f'<tool_call>\n{{"name": "{tool}", "arguments": {{"',
                              add_special_tokens=False)
    rng, finished, calls = random.Random(11), 0, 0
    for _ in range(20):
        text = _walk(compiled, vocab, rng, steps=120, prefix=prefix)
        if text is None:
            continue
        finished += 1
        for body in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S):
            call = json.loads(body)
            jsonschema.validate(call["arguments"], schemas[call["name"]])
            calls += 1
    assert finished >= 5 and calls >= finished

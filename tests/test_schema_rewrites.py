"""Tables for the oneOf disjointness proofs (grammar/schema_oneof.py) and the
one-node rewrites (grammar/schema_rewrites.py, schema_lengths.py).

Every accepted case goes through the real pipeline (`to_xgrammar`: checks,
rewrites, xgrammar conversion) and is judged by jsonschema against the
ORIGINAL schema: listed instances must be valid and accepted by the grammar,
or invalid and refused; random walks of a character-level xgrammar matcher
must only finish on instances the original schema admits. Cases with a
`pattern` are refused by xgrammar (it compiles patterns loosely) and judged the
same way through the backend `auto` gives them, llguidance (`to_llguidance`,
which falls back to the same rewrites), with a character-level llguidance matcher.
"""
from __future__ import annotations

import json
import random

import jsonschema
import llguidance as llg
import pytest
import torch
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from formwork.grammar.backend import allocate_bitmask, allowed_token_ids
from formwork.grammar.llguidance_grammar import to_llguidance
from formwork.grammar.schema_check import UnsupportedSchemaError, check_schema, find_issues
from formwork.grammar.schema_lengths import fold_lengths
from formwork.grammar.schema_oneof import pairwise_disjoint
from formwork.grammar.xgrammar_backend import to_xgrammar
from formwork.schemas.structured import StructuredOutputsParams

D4 = "http://json-schema.org/draft-04/schema#"
D7 = "http://json-schema.org/draft-07/schema#"
STR, INT = {"type": "string"}, {"type": "integer"}


def _obj(props: dict, required: list, closed: bool = True, **kw) -> dict:
    out = {"type": "object", "properties": props, "required": required} | kw
    return out | ({"additionalProperties": False} if closed else {})


REPO = {"oneOf": [_obj({"type": {"enum": ["composer"]}, "url": STR}, ["type"], closed=False),
                  _obj({"type": {"enum": ["vcs", "git"]}}, ["type"], closed=False)]}
PETS = {"$defs": {
    "Cat": _obj({"pet_type": {"const": "cat", "title": "Pet Type"}, "meows": INT},
                ["pet_type", "meows"], closed=False, title="Cat"),
    "Dog": _obj({"pet_type": {"const": "dog", "title": "Pet Type"}, "barks": {"type": "number"}},
                ["pet_type", "barks"], closed=False, title="Dog")},
    "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
    "discriminator": {"propertyName": "pet_type",
                      "mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog"}}}

# name -> (schema, valid instances, invalid instances); each must be accepted.
AS_WRITTEN = {
    "required on an array type constrains nothing": (
        {"type": "array", "items": {"type": "object", "properties": {"n": STR}}, "required": ["n"]},
        [[], [{"n": "x"}]], [[{"n": 1}], {"n": "x"}]),
    "oneOf: pydantic discriminated union": (
        PETS, [{"pet_type": "cat", "meows": 2}, {"pet_type": "dog", "barks": 1.5}],
        [{"pet_type": "cat", "barks": 1}, {"pet_type": "cow", "meows": 1}, {}]),
    "oneOf: discriminator on untyped branches": (
        {"oneOf": [{"required": ["k"], "properties": {"k": {"enum": ["a"]}, "m": STR}},
                   {"required": ["k"], "properties": {"k": {"enum": ["b"]}}}]},
        [{"k": "a", "m": "x"}, {"k": "b"}], [{"k": "c"}, {}, "x", 3]),
    "oneOf: required key the other branch forbids": (
        {"oneOf": [_obj({"t": {"enum": ["disk"]}, "device": STR}, ["t", "device"]),
                   _obj({"t": {"enum": ["disk"]}, "label": STR}, ["t", "label"])]},
        [{"t": "disk", "device": "a"}, {"t": "disk", "label": "b"}],
        [{"t": "disk"}, {"t": "disk", "device": "a", "label": "b"}]),
    "oneOf: $ref to a oneOf vs an enum and a map": (
        {"definitions": {"repo": REPO}, "type": "object", "properties": {
            "one": {"oneOf": [{"$ref": "#/definitions/repo"}, {"type": "boolean", "enum": [False]}]},
            "many": {"type": "array", "items": {"oneOf": [
                {"$ref": "#/definitions/repo"},
                {"type": "object", "additionalProperties": {"type": "boolean", "enum": [False]},
                 "minProperties": 1, "maxProperties": 1}]}}}},
        [{"one": False}, {"one": {"type": "git"}}, {"many": [{"type": "composer"}, {"x": False}]},
         {"many": [{"type": False}]}],
        [{"one": True}, {"one": {"type": "svn"}}, {"many": [{"x": True}]}]),
    "oneOf: enum value outside the other pattern": (
        {"oneOf": [{"type": "string", "pattern": "^[a-f0-9]{4}$"}, {"type": "string", "enum": [""]},
                   {"type": "null"}]}, ["abcd", "", None], ["abc", "zzzz", 1]),
    "oneOf: anchored patterns with different literal prefixes": (
        {"oneOf": [{"type": "string", "pattern": "^http://x.org/Pos$"},
                   {"type": "string", "pattern": "^http://x.org/Vel$"}]},
        ["http://x.org/Pos", "http://x.org/Vel"], ["http://x.org/Acc", "Pos"]),
    "patternProperties: patterns no name can match both": (
        {"type": "object", "patternProperties": {"^a_.*": INT, "^b_.*": STR},
         "additionalProperties": False},
        [{"a_1": 1, "b_x": "s"}, {}], [{"a_1": "s"}, {"b_": 1}, {"c": 1}]),
    "patternProperties: a property meaning the same as its pattern": (
        {"type": "object", "properties": {"search": {"type": "boolean", "description": "d"}},
         "patternProperties": {".*": {"type": "boolean"}}},
        [{"search": True, "x": False}, {}], [{"search": 1}, {"x": "s"}]),
}
# Like AS_WRITTEN, but flagged as written and accepted once rewritten.
REWRITES = {
    "enum values that violate siblings are dropped": (
        {"type": "object", "properties": {"b": {"type": "string", "enum": ["A", 1, "B"]}}},
        [{"b": "A"}, {"b": "B"}, {}], [{"b": 1}, {"b": "C"}]),
    "enum next to `not`: the values decide": (
        {"allOf": [{"enum": [1.0, 2, "a"]}, {"not": {"const": 2}}, {"not": {"type": "string"}}]},
        [1], [2, "a", 3]),                     # xgrammar writes 1.0 as 1
    "enum with no admissible value forbids the property": (
        {"type": "object", "properties": {"b": {"type": "object", "enum": ["X"]}, "c": INT}},
        [{"c": 1}, {}], [{"b": "X"}, {"b": {}}]),
    "required names declared from additionalProperties": (
        {"type": "object", "required": ["a", "b"], "additionalProperties": INT},
        [{"a": 1, "b": 2}], [{"a": 1}, {"a": "x", "b": 2}]),
    "lengths folded into a class repetition": (
        {"type": "string", "pattern": "^[a-z0-9-]+$", "minLength": 3, "maxLength": 5},
        ["abc", "a-b-c"], ["ab", "abcdef", "ab_", ""]),
    "lengths count code points": (
        {"type": "string", "pattern": "^[^x]*$", "maxLength": 2},
        ["", "é😀", "ab"], ["é😀a", "x"]),
    "lengths with a fixed prefix": (
        {"type": "string", "pattern": "^[A-Z][a-z]*$", "maxLength": 3},
        ["A", "Abc"], ["Abcd", "abc", ""]),
    "untyped pattern: non-strings stay valid": (
        {"type": "object", "properties": {"t": {"pattern": "^(a|b)$"}}},
        [{"t": "a"}, {"t": 3}, {"t": None}], [{"t": "c"}]),
    "draft-07 dependencies, array form": (
        {"$schema": D7, "type": "object", "properties": {"a": INT, "b": INT, "c": INT},
         "additionalProperties": False, "dependencies": {"a": ["b"]}},
        [{"a": 1, "b": 2}, {"b": 2}, {}, {"b": 1, "c": 3}], [{"a": 1}, {"a": 1, "c": 3}]),
    "draft-04 dependencies, schema form": (
        {"$schema": D4, "type": "object", "required": ["id"], "additionalProperties": False,
         "properties": {"id": STR, "website": STR, "type": STR},
         "dependencies": {"website": {"properties": {"type": {"enum": ["section"],
                                                              "type": "string"}}}}},
        [{"id": "1", "website": "w", "type": "section"}, {"id": "1", "type": "story"},
         {"id": "1", "website": "w"}],
        [{"id": "1", "website": "w", "type": "story"}, {"website": "w"}]),
    "2020-12 dependentRequired": (
        {"type": "object", "properties": {"x": INT, "y": INT, "z": INT},
         "dependentRequired": {"x": ["y"], "y": ["z"]}},
        [{}, {"z": 1}, {"y": 1, "z": 2}, {"x": 1, "y": 2, "z": 3}],
        [{"x": 1}, {"x": 1, "y": 2}, {"y": 1}]),
    "draft-04 dependency schema whose enum excludes the property's": (   # WashingtonPost
        {"$schema": D4, "type": "object", "required": ["id"], "additionalProperties": False,
         "properties": {"id": STR, "website": STR, "type": {"enum": ["site"]}},
         "dependencies": {"website": {"properties": {"type": {"enum": ["section"],
                                                              "type": "string"}}}}},
        [{"id": "1", "website": "w"}, {"id": "1", "type": "site"}, {"id": "1"}],
        [{"id": "1", "website": "w", "type": "site"}, {"id": "1", "type": "section"}]),
    "not required: one of the names absent": (
        {"type": "object", "properties": {"a": INT, "b": INT, "c": INT},
         "additionalProperties": False, "not": {"required": ["a", "b"]}},
        [{}, {"a": 1}, {"b": 1, "c": 2}], [{"a": 1, "b": 2}, {"a": 1, "b": 2, "c": 3}]),
    "not anyOf required: every name absent (semgrep's exclusive keys)": (
        {"type": "object", "required": ["m"], "additionalProperties": False,
         "properties": {"m": STR, "p": STR, "ps": STR, "pe": STR},
         "oneOf": [{"required": ["p"], "not": {"anyOf": [{"required": ["ps"]}, {"required": ["pe"]}]}},
                   {"required": ["ps"], "not": {"anyOf": [{"required": ["p"]}, {"required": ["pe"]}]}},
                   {"required": ["pe"], "not": {"anyOf": [{"required": ["p"]}, {"required": ["ps"]}]}}]},
        [{"m": "x", "p": "y"}, {"m": "x", "ps": "y"}, {"m": "x", "pe": "y"}],
        [{"m": "x"}, {"m": "x", "p": "y", "ps": "z"}, {"p": "y"}]),
    "not allOf required and a required name": (
        {"type": "object", "properties": {"a": INT, "b": INT}, "required": ["a"],
         "additionalProperties": False, "not": {"allOf": [{"required": ["a"]}, {"required": ["b"]}]}},
        [{"a": 1}], [{"a": 1, "b": 2}, {}]),
    "not {} forbids a property (WashingtonPost)": (
        {"type": "object", "additionalProperties": False,
         "properties": {"a": INT, "type": {"not": {}}, "v": {"not": {}}}},
        [{"a": 1}, {}], [{"type": 1}, {"a": 1, "v": "x"}]),
    "oneOf: closed objects that share only {}": (
        {"type": "object", "oneOf": [_obj({"next": STR}, []), _obj({"prev": STR}, [])]},
        [{"next": "a"}, {"prev": "b"}], [{}, {"next": "a", "prev": "b"}, {"x": 1}]),
    "oneOf: $ref branches that share only {}": (
        {"$schema": D4, "definitions": {
            "a": {"type": "object", "properties": {"x": STR, "y": STR}, "additionalProperties": False},
            "b": {"properties": {"z": INT}, "additionalProperties": False}},
         "oneOf": [{"$ref": "#/definitions/a"}, {"$ref": "#/definitions/b"}]},
        [{"x": "a", "y": "b"}, {"z": 1}], [{}, {"x": "a", "z": 1}]),
    "oneOf under a $ref target that no keyword leads to": (   # vtestunit-schema
        {"$schema": D7, "definitions": {"group": {"full": {"type": "array", "items": {"oneOf": [
            {"type": "object", "properties": {"src": STR}, "additionalProperties": False},
            {"type": "object", "properties": {"lib": STR}, "additionalProperties": False}]}}}},
         "type": "object", "properties": {"files": {"$ref": "#/definitions/group/full"}}},
        [{"files": [{"src": "a"}, {"lib": "b"}]}, {}], [{"files": [{}]}, {"files": [{"src": "a", "lib": "b"}]}]),
    "if/then on a listed discriminator (drupal-info)": (
        {"$schema": D7, "type": "object", "required": ["name"], "additionalProperties": False,
         "properties": {"name": STR, "type": {"enum": ["module", "theme", "profile"]},
                        "configure": STR, "engine": STR, "base": INT},
         "allOf": [{"if": {"properties": {"type": {"const": "module"}}},
                    "then": {"properties": {"engine": False}}},
                   {"if": {"properties": {"type": {"const": "theme"}}, "required": ["type"]},
                    "then": {"required": ["engine"]}, "else": {"properties": {"base": False}}}]},
        [{"name": "a"}, {"name": "a", "configure": "c"}, {"name": "a", "type": "theme", "engine": "t", "base": 1},
         {"name": "a", "type": "profile", "engine": "x"}, {"name": "a", "type": "module"}],
        [{"name": "a", "engine": "t"}, {"name": "a", "type": "module", "engine": "t"},
         {"name": "a", "type": "theme"}, {"name": "a", "base": 1}, {"name": "a", "type": "other"}]),
    "oneOf over which properties are present (Glaive's calculate_area)": (
        {"type": "object", "properties": {"radius": INT, "width": INT, "height": INT, "base": INT},
         "oneOf": [{"not": {"required": ["width", "height", "base"]}, "required": ["radius"]},
                   {"not": {"required": ["radius", "base"]}, "required": ["width", "height"]},
                   {"not": {"required": ["radius", "width"]}, "required": ["base", "height"]}]},
        [{"radius": 1}, {"width": 1, "height": 2}, {"height": 2, "base": 1}, {"radius": 1, "width": 2}],
        [{}, {"radius": 1, "width": 1, "height": 2}, {"radius": 1, "base": 1, "height": 2},
         {"width": 1, "height": 2, "base": 3},
         {"radius": 1, "width": 1, "height": 1, "base": 1}, {"width": 1}, {"radius": "x"}]),
    "oneOf of closed objects that overlap: only objects meeting one branch": (
        {"oneOf": [_obj({"a": STR}, []), _obj({"a": STR, "b": STR}, ["b"]),
                   _obj({"b": STR, "c": STR}, ["b"])]},
        [{}, {"a": "x"}, {"a": "x", "b": "y"}, {"b": "y", "c": "z"}],
        [{"b": "y"}, {"a": "x", "c": "z"}, {"b": 1, "c": "z"}]),
    "propertyNames pattern over additional properties": (
        {"type": "object", "propertyNames": {"pattern": "^[1-9][0-9]*$"},
         "additionalProperties": {"type": "string", "maxLength": 4}},
        [{}, {"16": "a.pn"}, {"16": "ab", "32": "cd"}],
        [{"x": "a"}, {"16": 3}, {"016": "a"}, {"16": "abcde"}]),
    "uniqueItems on at most one item says nothing": (
        {"type": "object", "properties": {"t": {"type": "array", "items": INT, "maxItems": 1,
                                                "uniqueItems": True},
                                          "u": {"type": "array", "items": INT, "uniqueItems": False}}},
        [{"t": [1]}, {"t": []}, {"u": [1, 1]}], [{"t": [1, 2]}, {"u": ["a"]}]),
    "oneOf: arrays that share only []": (
        {"oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "array", "items": STR},
                   {"type": "null"}]},
        [[1, 2.5], ["a"], None], [[], [1, "a"]]),
    "anyOf next to a vacuous additionalProperties": (
        {"$schema": D4, "additionalProperties": {}, "anyOf": [
            {"$ref": "#/definitions/a"}, {"$ref": "#/definitions/b"}], "definitions": {
            "a": _obj({"kind": {"enum": ["a"]}}, ["kind"]), "b": _obj({"n": INT}, ["n"])}},
        [{"kind": "a"}, {"n": 1}], [{"kind": "b"}, {"n": "1"}, {}]),
}
ACCEPTED = AS_WRITTEN | REWRITES

# name -> (schema, an instance jsonschema admits that the rejection protects, or
# None when the schema is rejected because the overlap is real).
STILL_REJECTED = {
    "oneOf: enum inside the other branch": (
        {"oneOf": [{"type": "string", "enum": ["a", "b"]}, {"type": "string"}]}, "a"),
    "oneOf: prefixes that can agree": ({"oneOf": [{"type": "string", "pattern": "^ab"},
                                                  {"type": "string", "pattern": "^a."}]}, "ab"),
    "oneOf: top-level alternation": ({"oneOf": [{"type": "string", "pattern": "^a|b"},
                                                {"type": "string", "pattern": "^b"}]}, "b"),
    "oneOf: integer inside number": ({"oneOf": [INT, {"type": "number", "minimum": 0}]}, 1),
    "oneOf: discriminator not required": (
        {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}},
                   {"type": "object", "properties": {"k": {"const": "b"}}}]}, {}),
    "patternProperties: a name may match both": (
        {"type": "object", "patternProperties": {"^a": INT, "^ab": {"type": "integer", "minimum": 3}}},
        None),
    "patternProperties: a property stricter than its pattern": (
        {"type": "object", "properties": {"x_": {"type": "integer", "minimum": 5}},
         "patternProperties": {"^x_": INT}}, None),
    "lengths next to a pattern with two variable parts": (
        {"type": "string", "pattern": "^(\\d+\\.\\d+.*)$", "maxLength": 5}, None),
    # xgrammar would take it through a rewrite, but its patterns are loose; llguidance
    # does not implement propertyNames, outlines-core neither.
    "propertyNames next to declared properties": (
        {"type": "object", "properties": {"ab": INT}, "propertyNames": {"pattern": "^[0-9]+$"}},
        None),
    "not of a pattern": ({"type": "string", "not": {"pattern": "^a"}}, None),
    "if/then on a free-string discriminator": (
        {"type": "object", "properties": {"t": STR, "a": INT}, "additionalProperties": False,
         "if": {"properties": {"t": {"const": "x"}}, "required": ["t"]}, "then": {"required": ["a"]}},
        None),
    "not required on a node that may be a string": (
        {"type": ["object", "string"], "properties": {"a": INT}, "not": {"required": ["a"]}}, None),
}


def _valid(schema, instance) -> bool:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema).is_valid(instance)


def _grammar(schema) -> xgr.Grammar:
    return to_xgrammar(StructuredOutputsParams(json=schema, whitespace="compact"))


def _text(instance) -> str:
    return json.dumps(instance, separators=(",", ":"), ensure_ascii=False)


def _patterned(schema) -> bool:
    """Served by llguidance: xgrammar refuses patterns and pattern property names."""
    return '"pattern"' in json.dumps(schema) or '"patternProperties"' in json.dumps(schema)


def _accepts(schema, text: str) -> bool:
    """Whole-text acceptance by the backend that serves `schema` (see module doc)."""
    if not _patterned(schema):
        return _is_grammar_accept_string(_grammar(schema), text)
    matcher = _llg_matcher(schema)
    ids = _llg_ids(text)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) \
        and matcher.is_accepting()


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted_rewrites_agree_with_jsonschema_on_the_original(name):
    schema, good, bad = ACCEPTED[name]
    if _patterned(schema):
        assert {"pattern", "patternProperties"} & {i.keyword for i in find_issues(schema, "xgrammar")}
    elif name in REWRITES:
        assert find_issues(schema, "xgrammar"), "not a rewrite case: nothing was flagged"
        assert check_schema(schema, "xgrammar") is not schema
    else:
        assert find_issues(schema, "xgrammar") == []
    for instance in good:
        assert _valid(schema, instance), instance
        assert _accepts(schema, _text(instance)), instance
    for instance in bad:
        assert not _valid(schema, instance), instance
        assert not _accepts(schema, _text(instance)), instance


@pytest.mark.parametrize("name", sorted(STILL_REJECTED))
def test_unprovable_cases_stay_rejected(name):
    schema, witness = STILL_REJECTED[name]
    with pytest.raises(UnsupportedSchemaError):
        check_schema(schema, "xgrammar")
    if "propertyNames" in schema:
        with pytest.raises(UnsupportedSchemaError, match="propertyNames"):
            to_llguidance(StructuredOutputsParams(json=schema))
    if witness is not None:       # the overlap is real: the oneOf refuses this, anyOf would not
        assert not _valid(schema, witness)
        assert _valid({"anyOf": schema["oneOf"]}, witness)


# --- random walks: every finished output validates against the original schema -------

_CHARS = [chr(c) for c in range(32, 127)] + ["é", "😀", "\n"]
_STOP = len(_CHARS)
_PREFER = set('"]},:0123456789')


@pytest.fixture(scope="module")
def char_compiler():
    info = xgr.TokenizerInfo(_CHARS + [""], xgr.VocabType.RAW, stop_token_ids=[_STOP])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


class _CharVocab:
    """llguidance's view of the same character vocabulary (the stop token special)."""
    eos_token_id, bos_token_id, special_token_ids = _STOP, None, [_STOP]
    tokens = [c.encode() for c in _CHARS] + [b"\xff<stop>"]

    def __call__(self, text):
        return _llg_ids(text.decode() if isinstance(text, bytes) else text)


_LLG_CHARS = llg.LLTokenizer(llg.TokenizerWrapper(_CharVocab()), n_vocab=_STOP + 1)


def _llg_ids(text: str) -> list[int]:
    return [_CHARS.index(ch) for ch in text]


def _llg_matcher(schema) -> llg.LLMatcher:
    grammar = to_llguidance(StructuredOutputsParams(json=schema, whitespace="compact"))
    matcher = llg.LLMatcher(_LLG_CHARS, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


class _LLGWalker:
    """The two xgrammar matcher calls `_walk` makes, over an llguidance matcher."""

    def __init__(self, matcher: llg.LLMatcher):
        self.m = matcher

    def fill_next_token_bitmask(self, bitmask, row):
        words = torch.frombuffer(bytearray(self.m.compute_bitmask()), dtype=torch.int32)
        bitmask[row].copy_(words)

    def accept_token(self, tid):
        return self.m.is_accepting() if tid == _STOP else self.m.consume_token(tid)


def _walk(matcher, rng, max_steps=120) -> str | None:
    bitmask, out = allocate_bitmask(1, _STOP + 1), []
    for _ in range(max_steps):
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = allowed_token_ids(bitmask, 0, _STOP + 1)
        if _STOP in allowed and rng.random() < 0.5:
            assert matcher.accept_token(_STOP)
            return "".join(out)
        chars = [t for t in allowed if t != _STOP]
        if not chars:
            return None
        preferred = [t for t in chars if _CHARS[t] in _PREFER]
        tid = rng.choice(preferred if preferred and rng.random() < 0.4 else chars)
        assert matcher.accept_token(tid)
        out.append(_CHARS[tid])
    return None


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_random_walks_only_finish_on_valid_instances(name, char_compiler):
    schema = ACCEPTED[name][0]
    if _patterned(schema):
        new_matcher = lambda: _LLGWalker(_llg_matcher(schema))  # noqa: E731
    else:
        compiled = char_compiler.compile_grammar(_grammar(schema))
        new_matcher = lambda: xgr.GrammarMatcher(compiled)  # noqa: E731
    rng, finished = random.Random(name), 0
    for _ in range(40):
        text = _walk(new_matcher(), rng)
        if text is not None:
            finished += 1
            assert _valid(schema, json.loads(text)), text
    assert finished >= 5


# --- unit tables ---------------------------------------------------------------------

@pytest.mark.parametrize("pattern,lo,hi,expected", [
    ("^[a-z0-9-]+$", 3, 10, "^[a-z0-9-]{3,10}$"),
    ("^\\w*$", None, 5, "^\\w{0,5}$"),
    ("^[A-Z_][^<>]*$", None, 260, "^[A-Z_][^<>]{0,259}$"),
    ("^(?:ab)+$", 3, 7, "^(?:ab){2,3}$"),
    ("^[\\]a]+?$", 0, 3, "^[\\]a]{1,3}$"),
    ("^ab$", 1, 5, "^ab$"),                       # implied: pattern unchanged
    ("^(?:ab)+$", 2049, None, None), ("^a*$", 0, 1025, None),   # slow to compile
    ("^ab$", 3, 5, None),                         # no string fits
    ("^a|b$", 1, 2, None), ("[a-z]+", 1, 3, None), ("^a+b?$", 0, 4, None),
    ("^(?=a)a+$", 0, 3, None), ("^\\d+\\$", 0, 3, None), ("^a++$", 0, 3, None),
    ("^(a|b)+$", 0, 3, None), ("^\\bx+$", 0, 3, None), ("^[[:alpha:]]+$", 0, 3, None),
])
def test_fold_lengths(pattern, lo, hi, expected):
    assert fold_lengths(pattern, lo, hi) == expected


def test_oneof_proofs_on_their_own():
    v = jsonschema.Draft202012Validator({})
    assert pairwise_disjoint([{"type": "string"}, {"type": "null"}], {}, v)
    assert pairwise_disjoint([{"const": 1}, {"const": 2}], {}, v)
    assert not pairwise_disjoint([{"const": 1}, {"const": 1.0}], {}, v)
    assert not pairwise_disjoint([{"const": 1}, {"type": "number"}], {}, v)
    assert not pairwise_disjoint([{"$ref": "#/nowhere"}, {"type": "null"}], {}, v)
    assert not pairwise_disjoint([{}, {"type": "null"}], {}, v)
    d4 = jsonschema.Draft4Validator({})        # draft 4: 1.0 is no integer, but 1 is
    assert not pairwise_disjoint([{"enum": [1.0]}, {"type": "integer"}], {}, d4)  # emits `1`
    assert not pairwise_disjoint([{"type": "integer"}, {"enum": [1.0]}], {}, d4)
    assert pairwise_disjoint([{"enum": [1.5]}, {"type": "integer"}], {}, d4)
    loop = {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}}
    assert not pairwise_disjoint([{"$ref": "#/$defs/a"}, {"type": "null"}], loop,
                                 jsonschema.Draft202012Validator(loop))


def test_dependencies_in_a_draft_without_them_are_enforced_anyway():
    """2020-12 defines no `dependencies`: jsonschema ignores it, the author (writing
    draft-07) meant it. Enforcing it generates a subset of what 2020-12 admits and
    exactly what draft-07 admits."""
    schema = {"type": "object", "properties": {"a": INT, "b": INT}, "dependencies": {"a": ["b"]},
              "additionalProperties": False}
    draft7 = schema | {"$schema": D7}
    for instance in ({}, {"b": 1}, {"a": 1, "b": 2}):
        assert _accepts(schema, _text(instance)) and _valid(draft7, instance)
    assert not _accepts(schema, _text({"a": 1})) and not _valid(draft7, {"a": 1})
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(_CHARS + [""], xgr.VocabType.RAW,
                                                     stop_token_ids=[_STOP]),
                                   max_threads=1, cache_enabled=False).compile_grammar(_grammar(schema))
    rng = random.Random(3)
    for _ in range(30):
        text = _walk(xgr.GrammarMatcher(compiled), rng)
        if text is not None:
            assert _valid(schema, json.loads(text)) and _valid(draft7, json.loads(text)), text


LISTED = {   # name -> (schema, valid, invalid): served by llguidance (the rewrite adds a pattern)
    "oneOf: listed strings inside a free string": (
        {"oneOf": [{"enum": ["/usr/bin/vim", "/usr/bin/vi", "é😀"]}, {"type": "string"}]},
        ["/usr/bin/v", "/usr/bin/vimx", "", "é", "x"], ["/usr/bin/vim", "/usr/bin/vi", "é😀", 3]),
    "oneOf: a listed value the string branch refuses stays": (
        {"oneOf": [{"enum": ["ab", "abcdef", 1]}, {"type": "string", "maxLength": 4}, {"type": "null"}]},
        ["abcdef", 1, "abc", "", None], ["ab", 2, "abcde"]),
}


@pytest.mark.parametrize("name", sorted(LISTED))
def test_listed_strings_leave_the_string_branch(name):
    schema, good, bad = LISTED[name]
    with pytest.raises(UnsupportedSchemaError):
        check_schema(schema, "xgrammar")
    for instance, expected in [(x, True) for x in good] + [(x, False) for x in bad]:
        assert _valid(schema, instance) == expected, instance
        m, ids = _llg_matcher(schema), _llg_ids(_text(instance))
        got = m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()
        assert got == expected, instance
    rng, finished = random.Random(name), 0
    for _ in range(40):
        text = _walk(_LLGWalker(_llg_matcher(schema)), rng)
        if text is not None:
            finished += 1
            assert _valid(schema, json.loads(text)), text
    assert finished >= 5


def test_listed_strings_another_branch_admits_stay_rejected():
    schema = {"oneOf": [{"enum": ["a"]}, {"type": "string"}, {"type": "string", "maxLength": 1}]}
    with pytest.raises(UnsupportedSchemaError):
        to_llguidance(StructuredOutputsParams(json=schema))


def test_llguidance_untyped_oneof_branches_generate_objects_only():
    """formwork proves untyped oneOf branches disjoint as the objects xgrammar infers
    from `properties`; llguidance generates every type for an untyped node, and
    "x" passes both branches (so it is invalid). The type is stated before
    llguidance sees the anyOf: found by this session, it generated "x"."""
    schema = AS_WRITTEN["oneOf: discriminator on untyped branches"][0]
    for text, expected in [('"x"', False), ("3", False), ("null", False),
                           ('{"k":"a","m":"y"}', True), ('{"k":"b"}', True)]:
        assert _valid(schema, json.loads(text)) == expected, text
        m, ids = _llg_matcher(schema), _llg_ids(text)
        assert (m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids)
                and m.is_accepting()) == expected, text
    rng = random.Random(11)
    for _ in range(40):
        text = _walk(_LLGWalker(_llg_matcher(schema)), rng)
        if text is not None:
            assert _valid(schema, json.loads(text)), text

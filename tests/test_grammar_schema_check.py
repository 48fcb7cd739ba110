"""The keyword table of grammar/schema_rules.py, checked against the libraries,
and the exact rewrites of grammar/schema_normalize.py.

For each flagged case the raw converter (our checks bypassed) really accepts
an instance jsonschema rejects: the flag is needed. For each enforced case our
checks pass and the compiled grammar agrees with jsonschema. If a library
upgrade starts enforcing a flagged keyword, the first test fails and the rule
can be relaxed.
"""
from __future__ import annotations

import json
import re

import jsonschema
import outlines_core as oc
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from formwork.grammar.native_log import call_capturing_warnings
from formwork.grammar.schema_check import check_metaschema, check_schema, find_issues
from formwork.grammar.schema_normalize import merge, normalize

OBJ_AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}

# name -> (schema, an instance jsonschema rejects that the raw backend accepts)
FLAGGED_BOTH = {
    "not": ({"type": "integer", "not": {"const": 3}}, 3),
    "if": ({"type": "object", "properties": OBJ_AB, "if": {"required": ["a"]},
            "then": {"required": ["b"]}}, {"a": 1}),
    "dependentRequired": ({"type": "object", "properties": OBJ_AB,
                           "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1]),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, [1]),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}, 1),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}},
                  "required": ["a", "zz"]}, {"a": 1}),
    "anyOf": ({"type": "string", "minLength": 2,
               "anyOf": [{"type": "string", "maxLength": 3}, {"type": "string"}]}, "a"),
    "enum": ({"type": "string", "enum": ["a", 1]}, 1),
}
FLAGGED_XGRAMMAR = {
    "allOf": ({"allOf": [{"type": "object", "properties": OBJ_AB, "required": ["a"]},
                         {"required": ["b"]}]}, {"a": 1}),
    "minLength": ({"type": "string", "pattern": "^[a-c]+$", "minLength": 2}, "a"),
    "maxLength": ({"type": "string", "format": "email", "maxLength": 8}, "abcdef@b.com"),
    "multipleOf": ({"type": "number", "multipleOf": 0.5}, 1.3),
    "patternProperties": ({"type": "object", "properties": {"x_": {"type": "string"}},
                           "patternProperties": {"^x_": {"type": "integer"}}}, {"x_": "s"}),
    "propertyNames": ({"type": "object", "properties": {"abc": {"type": "integer"}},
                       "propertyNames": {"maxLength": 2}}, {"abc": 1}),
    "$ref": ({"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p", "minimum": 3}, 1),
    "minimum": ({"minimum": 3}, 1),
}
FLAGGED_OUTLINES = {
    "minimum": ({"type": "integer", "minimum": 5}, 4),
    "maxProperties": ({"type": "object", "properties": OBJ_AB, "maxProperties": 1},
                      {"a": 1, "b": 2}),
    "maxLength": ({"type": "string", "pattern": "^[a-c]+$", "maxLength": 2}, "xy"),
    "pattern": ({"type": "string", "pattern": "^[^x]$"}, '"'),
    "propertyNames": ({"type": "object", "propertyNames": {"maxLength": 1},
                       "additionalProperties": {"type": "integer"}}, {"ab": 1}),
}
# name -> (schema, valid instances, invalid instances): enforced exactly or stricter.
ENFORCED = {
    "bounds": ({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": -5, "maximum": 100},
        "x": {"type": "number", "exclusiveMinimum": 0.5}}, "required": ["n", "x"]},
        [{"n": 5, "x": 0.75}], [{"n": -6, "x": 1}, {"n": 5, "x": 0.5}]),
    "strings": ({"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 3},
                 "minItems": 1, "maxItems": 2}, [["ab"], ["abc", "xy"]], [[], ["a"], ["abcd"]]),
    "disjoint oneOf": ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"},
                                                                     "x": {"type": "integer"}},
                                   "required": ["k", "x"], "additionalProperties": False},
                                  {"type": "object", "properties": {"k": {"const": "b"}},
                                   "required": ["k"], "additionalProperties": False}]},
                       [{"k": "a", "x": 1}, {"k": "b"}], [{"k": "c"}, {"k": "a"}]),
    "refs": ({"$defs": {"p": {"type": "string", "enum": ["u", "v"]}}, "type": "object",
              "properties": {"p": {"$ref": "#/$defs/p"}}, "required": ["p"]},
             [{"p": "u"}], [{"p": "w"}, {}]),
    "draft-07 ref siblings": ({"$schema": "http://json-schema.org/draft-07/schema#",
                               "definitions": {"p": {"type": "integer"}},
                               "$ref": "#/definitions/p", "maxItems": 1}, [3], ["x"]),
}


def _compact(instance) -> str:
    return json.dumps(instance, separators=(",", ":"))


def _xgrammar_raw_accepts(schema, instance) -> bool:
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                           separators=(",", ":"))
    return _is_grammar_accept_string(grammar, _compact(instance))


def _outlines_raw_accepts(schema, instance) -> bool:
    regex = oc.json_schema.build_regex_from_schema(json.dumps(schema), "")
    # '"' stands for the unescaped quote a pattern can let through: '"""' is not JSON.
    text = '"""' if instance == '"' else _compact(instance)
    return re.fullmatch(regex, text) is not None


def _is_valid(schema, instance) -> bool:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema).is_valid(instance)


@pytest.mark.parametrize("backend,name,case", [
    *[("xgrammar", n, c) for n, c in (FLAGGED_BOTH | FLAGGED_XGRAMMAR).items()],
    *[("outlines", n, c) for n, c in (FLAGGED_BOTH | FLAGGED_OUTLINES).items()],
])
def test_flagged_keywords_are_really_unenforced(backend, name, case):
    schema, bad = case
    check_metaschema(schema)
    assert name in {i.keyword for i in find_issues(schema, backend)}
    if name != "pattern":
        assert not _is_valid(schema, bad)
    raw = _xgrammar_raw_accepts if backend == "xgrammar" else _outlines_raw_accepts
    assert raw(schema, bad), f"{backend} now enforces {name}: relax the rule"


@pytest.mark.parametrize("name", sorted(ENFORCED))
def test_enforced_keywords_pass_check_and_agree_with_jsonschema(name):
    schema, good, bad = ENFORCED[name]
    assert find_issues(schema, "xgrammar") == []
    _, warnings = call_capturing_warnings(lambda: xgr.Grammar.from_json_schema(json.dumps(schema)))
    assert warnings == []
    for instance in good:
        assert _is_valid(schema, instance) and _xgrammar_raw_accepts(schema, instance)
    for instance in bad:
        assert not _is_valid(schema, instance) and not _xgrammar_raw_accepts(schema, instance)


def test_paths_point_at_the_keyword_and_skip_unused_definitions():
    schema = {"type": "object", "$defs": {"unused": {"type": "array", "uniqueItems": True},
                                          "tags": {"type": "array", "uniqueItems": True}},
              "properties": {"tags": {"$ref": "#/$defs/tags"},
                             "odd key": {"type": "array", "contains": {"const": 1}}}}
    found = [(i.keyword, i.path) for i in find_issues(schema, "xgrammar")]
    assert found == [("uniqueItems", "$.$defs.tags"), ("contains", "$.properties['odd key']")]


def test_metaschema_errors_name_the_path_and_respect_the_declared_draft():
    with pytest.raises(ValueError, match=r"invalid JSON Schema at \$\.properties\.a\.type"):
        check_metaschema({"type": "object", "properties": {"a": {"type": "strng"}}})
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "number",
              "minimum": 1, "exclusiveMinimum": True}
    check_metaschema(draft4)                       # valid in draft-04
    with pytest.raises(ValueError, match="exclusiveMinimum"):
        check_metaschema({k: v for k, v in draft4.items() if k != "$schema"})
    assert [i.keyword for i in find_issues(draft4, "xgrammar")] == ["exclusiveMinimum"]


def test_the_fast_metaschema_check_agrees_with_python_jsonschema():
    """check_metaschema trusts jsonschema-rs's "valid" (250x faster on the request
    path): it must never call valid what python-jsonschema refuses, on the vendored
    corpus and on hand-made invalid schemas of each draft."""
    import pathlib

    from formwork.grammar.schema_check import _meta_valid_fast, validator_class

    root = pathlib.Path(__file__).parent / "data" / "jsonschemabench"
    schemas = [json.loads(p.read_text()) for p in sorted(root.rglob("*.json"))]
    schemas = [d.get("schema", d) for d in schemas if isinstance(d, dict)]
    schemas += [{"type": "strng"}, {"properties": {"a": {"minLength": -1}}}, {"required": "a"},
                {"$schema": "http://json-schema.org/draft-04/schema#", "exclusiveMinimum": 3},
                {"$schema": "http://json-schema.org/draft-07/schema#", "items": [1]},
                {"pattern": 3}]
    fast_valid = 0
    for schema in schemas:
        if not isinstance(schema, dict) or not _meta_valid_fast(schema):
            continue
        fast_valid += 1
        validator_class(schema).check_schema(schema)     # raises if python-jsonschema disagrees
    assert fast_valid >= 20
    assert not any(_meta_valid_fast(s) for s in schemas[-6:])


# --- exact rewrites (grammar/schema_normalize.py) --------------------------------------

REWRITABLE = {
    "allOf + siblings": {"type": "object", "properties": {"a": {"type": "integer"}},
                         "required": ["a"], "allOf": [{"properties": {"b": {"type": "string"}},
                                                       "required": ["b"]}]},
    "allOf of $refs": {"definitions": {"base": {"type": "object", "required": ["a"],
                                                "properties": {"a": {"type": "integer"}}}},
                       "allOf": [{"$ref": "#/definitions/base"},
                                 {"properties": {"c": {"type": "string", "maxLength": 2}}}]},
    "oneOf + siblings": {"type": "object", "required": ["k"], "properties": {"k": {"type": "string"}},
                         "oneOf": [{"properties": {"k": {"const": "a"}, "n": {"type": "integer"}}},
                                   {"properties": {"k": {"const": "b"}}}]},
    "anyOf + required": {"type": "object", "properties": {"x": {"type": "integer"},
                                                          "y": {"type": "integer"}},
                         "anyOf": [{"required": ["x"]}, {"required": ["y"]}]},
}
PROBES = [None, 1, "s", [], {}, {"a": 1}, {"a": 1, "b": "x"}, {"b": "x"}, {"a": "1", "b": "x"},
          {"a": 1, "c": "xy"}, {"a": 1, "c": "xyz"}, {"k": "a"}, {"k": "b"}, {"k": "c"},
          {"k": "a", "n": 2}, {"k": "a", "n": "2"}, {"x": 1}, {"y": 2}, {"x": 1, "y": "2"}]


@pytest.mark.parametrize("name", sorted(REWRITABLE))
def test_rewrites_keep_meaning_and_make_schemas_enforceable(name):
    schema = REWRITABLE[name]
    assert find_issues(schema, "xgrammar")
    rewritten = check_schema(schema, "xgrammar")
    assert rewritten is not schema and find_issues(rewritten, "xgrammar") == []
    assert "allOf" not in json.dumps(rewritten)
    for instance in PROBES:
        assert _is_valid(schema, instance) == _is_valid(rewritten, instance), instance


def test_merge_refuses_what_a_plain_union_would_change():
    closed = {"properties": {"a": {}}, "additionalProperties": False}
    assert merge(closed, {"properties": {"b": {}}}) == closed        # b stays forbidden
    assert merge({"additionalProperties": {"type": "integer"}}, {"properties": {"b": {"minimum": 1}}}) \
        == {"additionalProperties": {"type": "integer"},
            "properties": {"b": {"type": "integer", "minimum": 1}}}
    assert merge({"patternProperties": {"^x": {}}}, closed) is None  # x.. would be allowed
    assert merge({"if": {}, "then": {}}, {"if": {}, "else": {}}) is None
    assert merge({"$ref": "#/a"}, {"type": "string"}, legacy=True) is None
    assert merge({"type": "string"}, {"type": "integer"}) is None
    assert merge({"type": ["number", "null"]}, {"type": "integer", "minimum": 2}) == \
        {"type": "integer", "minimum": 2}
    assert merge({"maxLength": 5, "required": ["a"]}, {"maxLength": 3, "required": ["b"]}) == \
        {"maxLength": 3, "required": ["a", "b"]}
    assert normalize({"anyOf": [{"type": "string"}]}) == {"anyOf": [{"type": "string"}]}


def test_native_warnings_become_rejections(monkeypatch):
    from formwork.grammar import schema_check
    from formwork.grammar.schema_check import UnsupportedSchemaError
    from formwork.grammar.xgrammar_backend import to_xgrammar
    from formwork.schemas.structured import StructuredOutputsParams

    lookahead = {"type": "string", "pattern": "^(?=.*a)[a-z]+$"}   # xgrammar drops (?=...)
    assert [i.keyword for i in find_issues(lookahead, "xgrammar")] == ["pattern"]
    assert _xgrammar_raw_accepts(lookahead, "bcd") and not _is_valid(lookahead, "bcd")
    # behind the static rules, xgrammar's own warning is the second net
    monkeypatch.setattr(schema_check, "find_issues", lambda schema, backend: [])
    with pytest.raises(UnsupportedSchemaError, match="'pattern' at \\$ .*Lookahead"):
        to_xgrammar(StructuredOutputsParams(json=lookahead))
    disjoint = {"oneOf": [{"type": "array"}, {"type": "null"}]}     # warned about, but exact
    to_xgrammar(StructuredOutputsParams(json=disjoint))

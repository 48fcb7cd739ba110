"""Constraints no output of which can end: refused for every backend, before
xgrammar's jump-forward runs on them (it never returned: `root ::= "a" root` hung
the engine thread until the process was killed, and each restart's replay again).
Also what stays served, and that the reader of xgrammar's grammars reads every
grammar formwork builds (where it cannot, jump-forward is off for that grammar)."""
from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from formwork.grammar.selection import choose_backend, validate_params
from formwork.grammar.xgrammar_backend import to_xgrammar
from formwork.grammar.xgrammar_productive import NoFiniteOutput, recursive_refs, unproductive_rules
from formwork.schemas.structured import StructuredOutputsParams as P

SELF_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
TREE_MIN_ONE = {"$defs": {"n": {"type": "object", "properties": {
    "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/n"},
                                       "minItems": 1}}, "required": ["v", "kids"]}},
    "$ref": "#/$defs/n"}


def _tag(schema: dict) -> dict:
    return {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"], "at_least_one": False,
        "stop_after_first": False, "tags": [{
            "type": "tag", "begin": '<tool_call>\n{"name": "f", "arguments": ',
            "content": {"type": "json_schema", "json_schema": schema},
            "end": "}\n</tool_call>"}]}}


@pytest.mark.parametrize("ebnf,rules", [
    ('root ::= "a" root', ["root"]),
    ('root ::= "b" | "a" x\nx ::= "a" x', ["x"]),
    ('root ::= x{0,3}\nx ::= "a" x', ["x"]),
    ('root ::= x{1,3}\nx ::= "a" x', ["root", "x"]),
    ('root ::= "a" root | ""', []),
    ('root ::= item+ ("," item)* [a-z]{2,5}\nitem ::= "x" | [0-9]* "y"?', []),
    ('root ::= "a\\"b" [^\\]"] (= "x")', []),
])
def test_unproductive_rules_of_ebnf(ebnf, rules):
    assert unproductive_rules(str(xgr.Grammar.from_ebnf(ebnf))) == rules


def test_a_construct_it_cannot_read_gives_no_verdict():
    assert unproductive_rules('root ::= Mystery("a")\n') is None
    assert unproductive_rules("not a grammar") is None
    assert unproductive_rules('root ::= (("a" undefined_rule))\n') is None


@pytest.mark.parametrize("params", [
    P(json={"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "kind": {"anyOf": [{"type": "null"}, {"type": "number"}]},
        "child": {"$ref": "#"}}, "required": ["name", "age"]}),
    P(json=TREE_MIN_ONE["$defs"]["n"] | {"properties": {"v": {"type": "integer"}}}),
    P(json_object=True), P(regex=r"[a-z]+@[a-z]+\.com"), P(choice=["a", 'b"c']),
    P(structural_tag=_tag({"type": "object", "properties": {"x": {"type": "integer"}},
                           "required": ["x"]})),
])
def test_every_grammar_formwork_builds_is_read(params):
    """Where the reader gives no verdict, jump-forward is off for that grammar:
    what formwork builds itself must be read, or it would lose jump-forward."""
    assert unproductive_rules(str(to_xgrammar(params))) == []


def test_recursive_refs():
    assert recursive_refs(SELF_REQUIRED) and recursive_refs(TREE_MIN_ONE)
    assert recursive_refs({"$defs": {"a": {"$ref": "#/$defs/b"},
                                     "b": {"items": {"$ref": "#/$defs/a"}}}, "$ref": "#/$defs/a"})
    assert not recursive_refs({"$defs": {"x": {"type": "integer"}},
                               "properties": {"a": {"$ref": "#/$defs/x"}, "b": {"$ref": "#/$defs/x"}}})


@pytest.mark.parametrize("params,where", [
    (P(grammar='root ::= "a" root'), "rule 'root' derives no finite text"),
    (P(grammar='root ::= "b" | "a" x\nx ::= "a" x'), "rule 'x' derives no finite text"),
    (P(json=SELF_REQUIRED), "'$ref' at $.properties.a (no finite instance"),
    (P(json=TREE_MIN_ONE), "'$ref' at $ (no finite instance"),
    (P(structural_tag=_tag(SELF_REQUIRED)), "no finite instance"),
])
@pytest.mark.parametrize("backend", ["auto", "llguidance", "xgrammar", "outlines"])
def test_no_output_that_ends_is_refused_on_every_backend(params, where, backend):
    """llguidance's mask, too, let the output into such a rule (it wrote `"a"` to
    max_tokens, invalid); `auto` does not fall back from this refusal. The
    gateway's check (llguidance first) refuses as the engine's choice does."""
    if backend == "outlines" and params.kind() in ("grammar", "structural_tag"):
        return                               # outlines-core serves neither kind
    params = P(**{params.kind(): params.spec(), "backend": backend})
    for check in (choose_backend, validate_params):
        with pytest.raises(ValueError) as err:
            check(params)
        assert isinstance(err.value, NoFiniteOutput)
        if params.kind() != "structural_tag" or backend != "xgrammar":
            assert where in str(err.value), str(err.value)


@pytest.mark.parametrize("params", [
    P(json={"type": "object", "properties": {"a": {"$ref": "#"}}}),        # optional: {} ends
    P(json={"$defs": {"n": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
        "required": ["v", "kids"]}}, "$ref": "#/$defs/n"}),               # kids may be []
    P(json={"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["a"]}),
    P(grammar='root ::= "(" root ")" | "x"'),
])
def test_recursion_with_a_way_out_is_served(params):
    assert choose_backend(params) in ("llguidance", "xgrammar")
    validate_params(params)


def test_engine_refuses_before_jump_forward(tiny_llm, monkeypatch):
    """Offline, `generate` refuses such a constraint itself (ValueError naming
    structured_outputs, as the server's 400); past that check, the engine (in-process)
    ends the request with its error (as any constraint it refuses), not a hang."""
    from formwork import SamplingParams, StructuredOutputsParams

    cases = (StructuredOutputsParams(grammar='root ::= "b" | "a" x\nx ::= "a" x',
                                     backend="xgrammar"),
             StructuredOutputsParams(json=json.loads(json.dumps(SELF_REQUIRED))))
    for so in cases:
        with pytest.raises(ValueError, match="no output that ends|no finite instance") as e:
            tiny_llm.generate("x", SamplingParams(max_tokens=8, structured_outputs=so),
                              use_tqdm=False)
        assert e.value.param == "structured_outputs"
    monkeypatch.setattr(tiny_llm, "_check_constraints", lambda params: None)
    for so in cases:
        out = tiny_llm.generate("x", SamplingParams(max_tokens=8, structured_outputs=so),
                                use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "error" and out.token_ids == []
        assert "no output that ends" in out.error or "no finite instance" in out.error
    assert not tiny_llm.engine.has_unfinished_requests()

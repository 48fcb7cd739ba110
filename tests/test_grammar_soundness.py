"""Regressions for the ways a mask let invalid output through or a rejection named
nothing (measured on held-out JSONSchemaBench schemas), one test per finding.
Every acceptance is judged against jsonschema on the original schema."""
from __future__ import annotations

import codecs
import json
import random
import re
from fractions import Fraction

import jsonschema
import pytest

from formwork.grammar.backend import allocate_bitmask, allowed_token_ids
from formwork.grammar.manager import build_backend
from formwork.grammar.schema_check import UnsupportedSchemaError
from formwork.grammar.schema_lengths import plain_length_pattern
from formwork.grammar.selection import choose_backend
from formwork.grammar.vocab import TokenVocab
from formwork.grammar.xgrammar_backend import to_xgrammar
from formwork.schemas.structured import StructuredOutputsParams as P

VOCAB = 49152
ALL = ("auto", "llguidance", "xgrammar", "outlines")


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return TokenVocab.from_tokenizer(tokenizer, VOCAB)


@pytest.fixture(scope="module")
def compile_for(tokenizer, vocab):
    backends: dict = {}

    def compile_(params: P):
        name = choose_backend(params)
        if name not in backends:
            backends[name] = build_backend(name, vocab, tokenizer)
        return name, backends[name].compile(params)
    return compile_


def accepts(compiled, tokenizer, vocab, text: str) -> bool:
    m = compiled.new_matcher()
    return m.accept_tokens(tokenizer.encode(text, add_special_tokens=False)) \
        and m.accept_tokens([vocab.eos_token_id]) and m.is_terminated()


def judge(compiled, tokenizer, vocab, schema, texts: dict[str, bool]) -> None:
    """Each text: accepted exactly when expected, and expectation == jsonschema's."""
    for text, expected in texts.items():
        try:
            valid = jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
        except json.JSONDecodeError:
            valid = False
        assert valid == expected, text
        assert accepts(compiled, tokenizer, vocab, text) == expected, text


PATTERNS = {   # pattern -> {JSON text: valid}
    "^\\d\\d(\\.\\d+)?$": {'"125"': False, '"12.5"': True, '"12"': True, '"1a"': False},
    "^[0-9]\\.[0-9]\\.[0-9](-[0-9A-Za-z]+)?$": {'"1.9.4abc"': False, '"1.9.4-abc"': True,
                                                  '"1.9.4"': True},
}


@pytest.mark.parametrize("backend", ["auto", "llguidance", "outlines"])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_patterns_are_enforced_exactly(backend, pattern, compile_for, tokenizer, vocab):
    schema = {"type": "string", "pattern": pattern}
    _, compiled = compile_for(P(json=schema, backend=backend))
    judge(compiled, tokenizer, vocab, schema, PATTERNS[pattern])


def test_xgrammar_refuses_patterns_it_would_compile_loosely():
    schema = {"type": "object", "properties": {"v": {"type": "string", "pattern": "^\\d\\d(\\.\\d+)?$"}}}
    with pytest.raises(UnsupportedSchemaError, match=r"'pattern' at \$\.properties\.v"):
        choose_backend(P(json=schema, backend="xgrammar"))
    assert choose_backend(P(json=schema)) == "llguidance"


def test_outlines_digits_are_ascii(compile_for, tokenizer, vocab):
    schema = {"type": "string", "pattern": "^\\d+$"}
    _, compiled = compile_for(P(json=schema, backend="outlines"))
    assert accepts(compiled, tokenizer, vocab, '"123"')
    assert not accepts(compiled, tokenizer, vocab, '"\u0661\u0662"')   # Arabic-Indic digits
    with pytest.raises(UnsupportedSchemaError, match="'pattern'"):
        choose_backend(P(json={"type": "string", "pattern": "^[\\D]+$"}, backend="outlines"))


# llguidance 1.9.1 let `\"` and `\\` through classes that exclude `"` or `\` (the
# usual "no quote" / "no backslash" patterns) when they also hold control characters
QUOTE_FREE = {
    '^[^"]*$': {'"a\\"b"': False, '"ab"': True, '"a\\\\b"': True, '"a\\tb"': True},
    '^[^\\\\]*$': {'"a\\\\b"': False, '"a\\"b"': True, '"ab"': True},
    '^[^"\\\\]+$': {'"\\""': False, '"\\\\"': False, '"x"': True},
    '^[^a"]+$': {'"\\""': False, '"b"': True},
    '^[^"\\n]*$': {'"a\\"b"': False, '"a\\nb"': False, '"ab"': True},
    '^[^"]*\\s': {'"\\"x "': False, '"x "': True},
    # positive classes spanning the control characters: intersected (Rust class syntax)
    '^[\\x00-\\x1fa]*$': {'"a\\"a"': False, '"a\\\\a"': False, '"a\\na"': True, '"aa"': True},
    '^[\\x00-!#-~]*$': {'"a\\"a"': False, '"a\\\\a"': True, '"a\\ta"': True},
}


@pytest.mark.parametrize("backend", ["auto", "llguidance"])
@pytest.mark.parametrize("pattern", sorted(QUOTE_FREE))
def test_a_class_without_quote_or_backslash_admits_neither_escaped(
        backend, pattern, compile_for, tokenizer, vocab):
    schema = {"type": "string", "pattern": pattern}
    _, compiled = compile_for(P(json=schema, backend=backend))
    judge(compiled, tokenizer, vocab, schema, QUOTE_FREE[pattern])


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"], "additionalProperties": False}


@pytest.mark.parametrize("backend", ALL)
def test_no_raw_control_character_inside_a_string(backend, compile_for, tokenizer, vocab):
    name, compiled = compile_for(P(json=CITY, backend=backend, whitespace="compact"))
    assert accepts(compiled, tokenizer, vocab, '{"city":"ab"}')
    for raw in ("\x1c", "\x00", "\t", "\n"):
        assert not accepts(compiled, tokenizer, vocab, '{"city":"a' + raw + 'b"}'), (name, raw)
    m = compiled.new_matcher()                      # nor does the mask offer one
    assert m.accept_tokens(tokenizer.encode('{"city":"a', add_special_tokens=False))
    bm = allocate_bitmask(1, VOCAB)
    m.fill_bitmask(bm, 0)
    allowed = allowed_token_ids(bm, 0, VOCAB)
    assert not [t for t in allowed if vocab.token_bytes[t] and any(b < 0x20 for b in vocab.token_bytes[t])]
    assert not set(allowed) & (set(vocab.special_ids) - {vocab.eos_token_id})


def test_xgrammar_plain_length_pattern_is_exact(compile_for, tokenizer, vocab):
    """The pattern formwork gives xgrammar for a length-bounded string: random texts
    over quotes, backslashes, controls and multi-byte characters are accepted
    exactly when they are JSON strings of 2..4 characters needing no escape."""
    schema = {"type": "string", "pattern": plain_length_pattern(2, 4)}
    _, compiled = compile_for(P(json={"type": "string", "minLength": 2, "maxLength": 4},
                                backend="xgrammar", whitespace="compact"))
    rng = random.Random(7)
    alphabet = ["a", "Z", " ", "\u00e9", "\U0001F600", '"', "\\", "\x1c", "\x7f", "\t"]
    for _ in range(150):
        body = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
        text = f'"{body}"'
        try:
            expected = jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)) and \
                len(json.loads(text)) == len(body)
        except json.JSONDecodeError:
            expected = False
        assert accepts(compiled, tokenizer, vocab, text) == expected, repr(text)


@pytest.mark.parametrize("schema,backend,keyword,path", [
    ({"type": "object", "properties": {"n": {"type": "integer", "maximum": 9223372036854776000}}},
     "xgrammar", "maximum", "$.properties.n"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 3, "items": False},
     "xgrammar", "minItems", "$"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 3, "items": False},
     "auto", "minItems", "$"),
    ({"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}},
     "auto", "uniqueItems", "$.properties.t"),
    ({"type": "object", "properties": {"s": {"type": "string", "format": "regex"}}},
     "llguidance", "format", "$.properties.s"),
    ({"type": "object", "properties": {"out": {}}, "required": ["out"]},
     "outlines", "properties", "$"),
    # ansible-lint's vars.json: a look-ahead in a patternProperties name, not the
    # `pattern` that comes first
    ({"anyOf": [{"type": "object", "additionalProperties": False,
                 "patternProperties": {"^(?!(and|or)$)[a-z]+$": {}}},
                {"type": "string", "pattern": "^\\$VAULT;"}]},
     "llguidance", "patternProperties", "$.anyOf[0].patternProperties"),
    ({"type": "string", "pattern": "^(?=a)\\w+$"}, "llguidance", "pattern", "$"),
    # the-federation.info's relay schema: outlines-core wrote "all|tags" between the
    # quotes unparenthesized, so a walk ended in `"scope":tags",` (not JSON)
    ({"type": "object", "properties": {"scope": {"type": "string", "pattern": "^all|tags$"}}},
     "outlines", "pattern", "$.properties.scope"),
    ({"type": "string", "pattern": "a|b"}, "outlines", "pattern", "$"),
])
def test_every_rejection_names_keyword_and_path(schema, backend, keyword, path):
    with pytest.raises(UnsupportedSchemaError) as info:
        choose_backend(P(json=schema, backend=backend))
    issue = info.value.issues[0]
    assert (issue.keyword, issue.path) == (keyword, path), str(info.value)
    assert str(info.value).startswith(f"unsupported JSON Schema keyword '{keyword}' at {path}")


def test_huge_integer_bound_is_served_by_auto(compile_for, tokenizer, vocab):
    schema = {"type": "integer", "maximum": 9223372036854776000}
    name, compiled = compile_for(P(json=schema))
    assert name == "llguidance"
    judge(compiled, tokenizer, vocab, schema, {"12": True, "1.5": False, '"1"': False})


UNDECLARED = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_undeclared_properties_are_a_documented_choice(compile_for, tokenizer, vocab):
    """Default ("declared"): an object that lists properties and says nothing about
    others generates only the declared ones, on every backend (as OpenAI strict
    mode and vLLM's default). additional_properties="schema" (llguidance) generates
    what the schema allows; an explicit additionalProperties is always honoured."""
    for backend in ("auto", "llguidance", "xgrammar"):
        _, closed = compile_for(P(json=UNDECLARED, backend=backend, whitespace="compact"))
        assert accepts(closed, tokenizer, vocab, '{"a":1}')
        assert not accepts(closed, tokenizer, vocab, '{"a":1,"b":"x"}'), backend
    name, open_ = compile_for(P(json=UNDECLARED, whitespace="compact", additional_properties="schema"))
    assert name == "llguidance"
    judge(open_, tokenizer, vocab, UNDECLARED, {'{"a":1,"b":"x"}': True, '{"a":1}': True})
    explicit = UNDECLARED | {"additionalProperties": {"type": "string"}}
    _, compiled = compile_for(P(json=explicit, whitespace="compact"))
    judge(compiled, tokenizer, vocab, explicit, {'{"a":1,"b":"x"}': True, '{"a":1,"b":2}': False})
    with pytest.raises(ValueError, match="llguidance"):
        choose_backend(P(json=UNDECLARED, backend="xgrammar", additional_properties="schema"))


def test_contradictory_bounds_are_named():
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}}}
    for backend in ALL:
        with pytest.raises(ValueError, match=r"at \$\.properties\.a: minLength 5 > maxLength 2"):
            choose_backend(P(json=schema, backend=backend))


def test_outlines_root_array_next_to_properties(compile_for, tokenizer, vocab):
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 3,
              "properties": {"a": {"type": "integer"}}}
    _, compiled = compile_for(P(json=schema, backend="outlines", whitespace="compact"))
    judge(compiled, tokenizer, vocab, schema, {"[1,2]": True, "[]": True, "{}": False,
                                               '{"a":1}': False})


@pytest.mark.parametrize("prop,defs", [
    ({"description": "anything"}, {}),
    # behind a $ref too (random schemas, 2026-12-07: the output was a bare string)
    ({"$ref": "#/$defs/any"}, {"any": {}}),
    ({"$ref": "#/$defs/a"}, {"a": {"$ref": "#/$defs/b"}, "b": True}),
])
def test_outlines_refuses_untyped_properties_that_it_would_mangle(prop, defs):
    schema = {"type": "object", "properties": {"out": prop, "n": {"type": "integer"}},
              "required": ["out"], "additionalProperties": False} | ({"$defs": defs} if defs else {})
    with pytest.raises(UnsupportedSchemaError, match="'properties'.*admits any value"):
        choose_backend(P(json=schema, backend="outlines"))
    assert choose_backend(P(json=schema)) == "llguidance"


@pytest.mark.parametrize("fmt", ["date", "time", "uri", "email"])
def test_outlines_refuses_formats_its_regex_gets_wrong(fmt, compile_for, tokenizer, vocab):
    """outlines-core's format regexes: `date` took non-ASCII digits, `time` a raw
    backslash ("04:53:53\\*41": not JSON), `uri` a quote, `email` control
    characters (found by the corpus walks, Glaiveai2K/create_calendar_event_*)."""
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}},
              "required": ["v"], "additionalProperties": False}
    with pytest.raises(UnsupportedSchemaError, match=r"'format' at \$\.properties\.v"):
        choose_backend(P(json=schema, backend="outlines"))
    name, compiled = compile_for(P(json=schema, whitespace="compact"))   # auto still serves it
    assert name != "outlines"
    bad = {"date": '{"v":"\u0a6814-10-11"}', "time": '{"v":"04:53:53\\*41"}',
           "uri": '{"v":"http://a.bc/"x"}', "email": '{"v":"\x01"}'}[fmt]
    assert not accepts(compiled, tokenizer, vocab, bad)


def test_outlines_refuses_date_time(compile_for):
    """Its date-time regex admits days that do not exist (tests/test_grammar_formats.py);
    before that, its Unicode digits ("੨024-...") were the finding here."""
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": "date-time"}},
              "required": ["v"], "additionalProperties": False}
    with pytest.raises(UnsupportedSchemaError, match="'format' at \\$.properties.v"):
        compile_for(P(json=schema, backend="outlines", whitespace="compact"))


def test_a_schema_cannot_switch_llguidance_to_lenient():
    schema = {"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}
    with pytest.raises(UnsupportedSchemaError, match="'uniqueItems'"):
        choose_backend(P(json=schema, backend="llguidance"))


def test_oneof_proved_disjoint_by_formwork_is_served_by_llguidance(compile_for, tokenizer, vocab):
    schema = {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}, "n": {"type": "integer"}},
                         "required": ["k", "n"], "additionalProperties": False},
                        {"type": "object", "properties": {"k": {"const": "b"}},
                         "required": ["k"], "additionalProperties": False}]}
    name, compiled = compile_for(P(json=schema, whitespace="compact"))
    assert name == "llguidance"
    judge(compiled, tokenizer, vocab, schema, {'{"k":"a","n":1}': True, '{"k":"b"}': True,
                                               '{"k":"b","n":1}': False, '{"k":"c"}': False})


@pytest.mark.parametrize("params,expected", [
    (P(json={"type": "integer"}), "llguidance"),
    (P(json_object=True), "llguidance"),
    (P(json={"type": "array", "uniqueItems": True}, backend="guidance"), None),
    (P(regex="[a-z]+"), "llguidance"),
    (P(regex="\\p{L}+"), "llguidance"),
    (P(regex="[\\b]x"), "xgrammar"),                 # llguidance refuses the backspace class
    (P(choice=["a", "b"]), "llguidance"),
    (P(grammar='root ::= "a" | "b"'), "xgrammar"),
    (P(grammar='start: "a" | "b"'), "llguidance"),
    (P(choice=["a", "b"], backend="guidance"), "llguidance"),
])
def test_auto_order(params, expected):
    if expected is None:
        with pytest.raises(UnsupportedSchemaError, match="backend: llguidance"):
            choose_backend(params)
    else:
        assert choose_backend(params) == expected


def _walk_outputs(compiled, vocab, rng, steps=128):
    """Finished outputs of random walks under the mask (closing tokens favoured)."""
    bitmask = allocate_bitmask(1, VOCAB)
    closing = [i for i, b in enumerate(vocab.token_bytes) if b and any(c in b for c in b'}]"@.')
               and len(b) <= 2]
    for _ in range(12):
        m, out = compiled.new_matcher(), []
        for step in range(steps):
            m.fill_bitmask(bitmask, 0)
            allowed = set(allowed_token_ids(bitmask, 0, VOCAB))
            rest = sorted(allowed - {vocab.eos_token_id})
            if vocab.eos_token_id in allowed and (not rest or rng.random() < 0.3 or step > steps // 2):
                yield b"".join(vocab.token_bytes[t] for t in out).decode()
                break
            pick = [t for t in closing if t in allowed] if rng.random() < 0.5 else []
            tid = rng.choice(pick or rest)
            assert m.accept_tokens([tid]), getattr(m, "error", "") or f"mask allowed {tid}"
            out.append(tid)


@pytest.mark.parametrize("fmt,served", [("x-unknown", None), ("iri", "uri"),
                                        ("idn-email", "email")])
def test_llguidance_formats_it_lacks(fmt, served, compile_for, tokenizer, vocab):
    """A format no draft defines annotates only (served as a plain string); a defined
    one llguidance lacks is served as a narrower one it has (every URI is an IRI).
    Outputs validate against the original, formats checked. (`uri-reference` is a
    `uri` or a relative reference: tests/test_grammar_formats.py walks it.)"""
    schema = {"type": "object", "properties": {"s": {"type": "string", "format": fmt}},
              "required": ["s"], "additionalProperties": False}
    name, compiled = compile_for(P(json=schema, whitespace="compact"))
    assert name == "llguidance"
    checker = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    narrower = jsonschema.Draft202012Validator(
        {"type": "string", "format": served},
        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER) if served else None
    outputs = list(_walk_outputs(compiled, vocab, random.Random(fmt)))
    assert outputs
    for text in outputs:
        value = json.loads(text)
        assert checker.is_valid(value), text
        assert narrower is None or narrower.is_valid(value["s"]), text
    if served is None:
        assert accepts(compiled, tokenizer, vocab, '{"s":"any text"}')


def test_int64_lower_bound_is_raised_for_llguidance(compile_for, tokenizer, vocab):
    """llguidance cannot build a range down to -2**63 (protobuf's int64): the bound is
    raised by 1024, which only loses the lowest integers."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -2**63,
                                                     "maximum": 2**63 - 1}},
              "required": ["n"], "additionalProperties": False}
    name, compiled = compile_for(P(json=schema, whitespace="compact"))
    assert name == "llguidance"
    judge(compiled, tokenizer, vocab, schema, {'{"n":-12}': True, '{"n":9223372036854775807}': True,
                                               '{"n":9223372036854775808}': False})
    assert not accepts(compiled, tokenizer, vocab, '{"n":-9223372036854775808}')  # the loss
    for text in _walk_outputs(compiled, vocab, random.Random(5)):
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text


@pytest.mark.parametrize("extra", ["declared", "schema"])
def test_not_required_keeps_other_properties_for_llguidance(extra, compile_for, tokenizer, vocab):
    """package.json's shape: allOf [declared properties, anyOf [a and not b, b and not a]].
    llguidance enforces `properties: {b: false}`, so "b is absent" no longer closes the
    branch's object (which refused every property the other allOf branch declares)."""
    schema = {"allOf": [
        {"type": "object", "properties": {"name": {"type": "string"}}},
        {"anyOf": [{"properties": {"a": {"type": "integer"}}, "not": {"required": ["b"]}},
                   {"properties": {"b": {"type": "integer"}}, "not": {"required": ["a"]}}]}]}
    name, compiled = compile_for(P(json=schema, whitespace="compact", additional_properties=extra))
    assert name == "llguidance"
    judge(compiled, tokenizer, vocab, schema, {
        '{"name":"x","a":1}': True, '{"name":"x","b":2}': True, '{"name":"x"}': True,
        '{"name":"x","a":1,"b":2}': False, '{"name":"x","a":"1"}': False})
    if extra == "schema":
        judge(compiled, tokenizer, vocab, schema, {'{"name":"x","zz":[1]}': True})
    for text in _walk_outputs(compiled, vocab, random.Random(extra)):
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text


# oneOf branches that are open objects: closing them (the declared default) makes
# them look disjoint to llguidance, but the output is judged by the schema as written.
OPEN_ONE_OF = [
    # packer.json's provisioner: a branch requiring `a`, one that requires nothing
    {"type": "object", "properties": {"kind": {"type": "string"}},
     "oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
               {"type": "object", "properties": {"b": {"type": "integer"}}}]},
    {"type": "object", "properties": {"p": {"oneOf": [
        {"$ref": "#/$defs/x"}, {"type": "object", "properties": {"y": {"type": "boolean"}}}]}},
     "$defs": {"x": {"type": "object", "properties": {"x": {"format": "date"}}, "required": ["x"]}}},
]


@pytest.mark.parametrize("backend", ["auto", "llguidance"])
@pytest.mark.parametrize("schema", OPEN_ONE_OF)
def test_one_of_of_open_objects_is_not_proved_disjoint_by_closing_them(schema, backend):
    """Each of these has instances that pass two branches (`{"a": "x"}` passes the
    open second branch too), so a branch's closed form generates invalid output."""
    with pytest.raises(UnsupportedSchemaError) as info:
        choose_backend(P(json=schema, backend=backend))
    assert info.value.issues[0].keyword == "oneOf", str(info.value)


def test_one_of_disjoint_once_closed_is_served_closed(compile_for, tokenizer, vocab):
    """`{"a": 1, "b": 1}` passes both branches as written (invalid), but a branch
    closed to `a` never writes the `b` the other requires: served by default (what
    each branch generates is judged against the others as written), refused where
    objects stay open."""
    schema = {"oneOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    name, compiled = compile_for(P(json=schema, whitespace="compact"))
    assert name == "llguidance"
    judge(compiled, tokenizer, vocab, schema, {'{"a":1}': True, '{"b":2}': True,
                                               '{"a":1,"b":2}': False, '{}': False})
    for text in _walk_outputs(compiled, vocab, random.Random(0)):
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text
    with pytest.raises(UnsupportedSchemaError) as info:
        choose_backend(P(json=schema, additional_properties="schema"))
    assert info.value.issues[0].keyword == "oneOf", str(info.value)


@pytest.mark.parametrize("extra", ["declared", "schema"])
def test_one_of_disjoint_as_written_is_still_served_closed(extra, compile_for, tokenizer, vocab):
    """Branches told apart by a required discriminator stay disjoint whatever else
    an object holds: llguidance serves them, closed by default."""
    schema = {"type": "object", "oneOf": [
        {"properties": {"k": {"const": "a"}, "n": {"type": "integer", "format": "int32"}},
         "required": ["k"]},
        {"properties": {"k": {"const": "b"}, "s": {"type": "string", "format": "date"}},
         "required": ["k"]}]}
    name, compiled = compile_for(P(json=schema, whitespace="compact", additional_properties=extra))
    assert name == "llguidance"
    judge(compiled, tokenizer, vocab, schema, {
        '{"k":"a","n":1}': True, '{"k":"b","s":"2024-01-02"}': True, '{"k":"c"}': False,
        '{"k":"a","n":"1"}': False})
    judge(compiled, tokenizer, vocab, schema, {'{"k":"a","s":"x"}': True} if extra == "schema"
          else {})
    if extra == "declared":
        assert not accepts(compiled, tokenizer, vocab, '{"k":"a","s":"x"}')
    for text in _walk_outputs(compiled, vocab, random.Random(extra)):
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text


@pytest.mark.parametrize("fmt,served", [("iri", "uri"), ("iri-reference", "uri-reference"),
                                        ("idn-email", "email")])
def test_xgrammar_formats_it_lacks_are_served_narrower(fmt, served, compile_for, tokenizer, vocab):
    """xgrammar has no grammar for iri / iri-reference / idn-email and admitted any
    string for them ('})ega##' as an IRI, found on held-out schemas): they are served
    as the ASCII format it enforces. Walk outputs validate with formats checked."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "format": fmt}},
              "required": ["s"], "additionalProperties": False}
    name, compiled = compile_for(P(json=schema, whitespace="compact", backend="xgrammar"))
    assert name == "xgrammar"
    checker = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    assert not accepts(compiled, tokenizer, vocab, '{"s":"a b"}')
    outputs = list(_walk_outputs(compiled, vocab, random.Random(fmt)))
    assert outputs
    for text in outputs:
        value = json.loads(text)
        assert checker.is_valid(value), text
        assert jsonschema.Draft202012Validator.FORMAT_CHECKER.conforms(value["s"], served), text


@pytest.mark.parametrize("fmt", ["idn-hostname", "regex"])
def test_xgrammar_refuses_formats_it_would_not_enforce(fmt):
    with pytest.raises(UnsupportedSchemaError, match="format"):
        to_xgrammar(P(json={"type": "string", "format": fmt}, backend="xgrammar"))


def _utf8_prefix_ok(data: bytes) -> bool:
    """Whether `data` is well-formed UTF-8 or a prefix of it (the reference: Python's
    incremental decoder)."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
        return True
    except UnicodeDecodeError:
        return False


@pytest.mark.parametrize("params", [
    P(regex="a.b", backend="xgrammar"), P(regex="a.+b", backend="xgrammar"),
    P(regex="[^x]{1,6}", backend="xgrammar"),
    P(json={"type": "string", "maxLength": 4}, whitespace="compact", backend="xgrammar"),
    P(json={"type": "string"}, whitespace="compact", backend="xgrammar")],
    ids=["dot", "dot-plus", "negated-class", "maxLength", "string"])
def test_xgrammar_output_is_well_formed_utf8(params, compile_for, tokenizer, vocab):
    """xgrammar took a UTF-16 surrogate written in UTF-8 (ED A0 80) for `.` and in JSON
    strings, and overlong forms (E0 80 80) in length-bounded strings: the text then held
    three U+FFFD for one character ('a.b' matched 'a\\ufffd\\ufffd\\ufffdb', a maxLength
    could be exceeded). Mid-character, the mask allows exactly the well-formed
    continuations, and random walks biased to non-ASCII bytes end in text that matches."""
    name, compiled = compile_for(params)
    assert name == "xgrammar"
    byte_token = {b: t for t, b in enumerate(vocab.token_bytes[:VOCAB]) if b and len(b) == 1}
    start = tokenizer.encode("a" if params.regex and params.regex.startswith("a") else
                             ('"' if params.json else ""), add_special_tokens=False)
    bitmask = allocate_bitmask(1, VOCAB)
    for lead in (b"\xed", b"\xe0", b"\xf4"):
        m = compiled.new_matcher()
        assert m.accept_tokens(start)
        if not m.accept_tokens([byte_token[lead]]):
            continue
        m.fill_bitmask(bitmask, 0)
        allowed = [t for t in allowed_token_ids(bitmask, 0, VOCAB) if vocab.token_bytes[t]]
        assert allowed, lead
        assert all(_utf8_prefix_ok(lead + vocab.token_bytes[t]) for t in allowed), lead
        assert not m.accept_tokens([byte_token[{b"\xed": b"\xa0", b"\xe0": b"\x80",
                                                 b"\xf4": b"\x90"}[lead]]])
    high = [t for b, t in byte_token.items() if b[0] >= 0x80]
    rng = random.Random(str(params.regex or params.json))
    for _ in range(20):
        m, out = compiled.new_matcher(), list(start)
        assert m.accept_tokens(start)
        for step in range(24):
            m.fill_bitmask(bitmask, 0)
            allowed = set(allowed_token_ids(bitmask, 0, VOCAB))
            if vocab.eos_token_id in allowed and (step > 12 or len(allowed) == 1):
                break
            pick = [t for t in high if t in allowed] if rng.random() < 0.8 else []
            tid = rng.choice(pick or sorted(allowed - {vocab.eos_token_id}))
            assert m.accept_tokens([tid])
            out.append(tid)
        else:
            continue
        text = b"".join(vocab.token_bytes[t] for t in out).decode()    # strict: well-formed
        if params.regex:
            assert re.fullmatch(params.regex, text), text
        else:
            assert jsonschema.Draft202012Validator(params.json).is_valid(json.loads(text)), text


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar", "outlines"])
def test_property_names_that_need_escapes(backend, compile_for, tokenizer, vocab):
    """A property literally named '^\\w+$' (a held-out schema's): outlines-core wrote the
    backslash raw, so the output was not JSON; it now refuses naming `properties`.
    The others escape such names: every walk output is JSON and validates."""
    schema = {"type": "object", "properties": {"^\\w+$": {"type": "integer"},
                                               'say "hi"': {"type": "boolean"}},
              "required": ["^\\w+$", 'say "hi"'], "additionalProperties": False}
    params = P(json=schema, whitespace="compact", backend=backend)
    if backend == "outlines":
        with pytest.raises(UnsupportedSchemaError, match="properties"):
            compile_for(params)
        return
    _, compiled = compile_for(params)
    outputs = list(_walk_outputs(compiled, vocab, random.Random(backend)))
    assert outputs
    for text in outputs:
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text


@pytest.mark.parametrize("params,texts", [
    (P(regex="\\d+-\\w+", backend="llguidance"), {"12-ab_9": True, "１２-ab": False, "12-é": False}),
    (P(regex="\\p{L}+\\d"), {"é1": True, "é１": False}),
    (P(regex="\\d+-\\w+", backend="xgrammar"), {"12-ab_9": True, "１２-ab": False, "12-é": False}),
    (P(regex="\\d+-\\w+", backend="outlines"), {"12-ab_9": True, "１２-ab": False, "12-é": False}),
])
def test_regex_classes_are_ascii_on_every_backend(params, texts, compile_for, tokenizer, vocab):
    """llguidance's and outlines-core's regex \\d / \\w are Unicode-aware (Rust): walks
    wrote '൮5𞥖' for \\d{4}; xgrammar (what `auto` picks for most regexes) and JSON Schema
    read them as ASCII."""
    name, compiled = compile_for(params)
    assert name == (params.backend if params.backend != "auto" else "llguidance")
    for text, expected in texts.items():
        m = compiled.new_matcher()
        got = m.accept_tokens(tokenizer.encode(text, add_special_tokens=False)) \
            and m.accept_tokens([vocab.eos_token_id]) and m.is_terminated()
        assert got == expected, text


# Characters where the readings of a class differ: Python's `re` (what jsonschema
# checks `pattern` with) calls ١ and ٣ digits, é and ² word characters, \x1c and \x85
# spaces and U+FEFF not one; ECMA-262 (JSON Schema's regex dialect) the opposite.
# U+D7FF and U+E000 border the surrogate gap: llguidance's negated class admitted
# both wherever it held both ([^\W_], [^\S], [^\D]).
DISPUTED = ["1", "\u0661", "\u00b2", "a", "\u00e9", "_", " ", "\x1c", "\x85", "\u00a0",
            "\ufeff", "\u2028", "\r", "-", "\ud7ff", "\ue000"]
CLASS_FORMS = ["\\d", "\\D", "\\w", "\\W", "\\s", "\\S", "[\\d]", "[^\\d]", "[\\W]", "[^\\w]",
               "[\\s]", "[^\\s]", "[\\S]", "[^\\S]", ".", "[^\\W_]", "[^\\D]", "[^\\W\\d]",
               "[^\\uD7FF\\uE000]", "[^a]"]


@pytest.mark.parametrize("backend,kind", [("xgrammar", "regex"), ("llguidance", "regex"),
                                          ("outlines", "regex"), ("llguidance", "json"),
                                          ("outlines", "json")])
def test_a_class_generates_only_what_python_and_ecma_both_match(backend, kind, compile_for,
                                                                tokenizer, vocab):
    """Before, every backend's \\D took '١' (Python: a digit), \\S and \\W '\\x1c' (Python:
    a space) and xgrammar's \\s U+FEFF (Python: not a space): a walk could write a
    string jsonschema's `pattern` check refuses. Now a character is accepted for a
    class only where Python's `re` matches it too."""
    checked = 0
    for form in CLASS_FORMS:
        params = P(regex=f"a{form}b", backend=backend) if kind == "regex" else \
            P(json={"type": "string", "pattern": f"^a{form}b$"}, backend=backend)
        try:
            _, compiled = compile_for(params)
        except UnsupportedSchemaError:
            assert backend == "outlines" and kind == "json"    # its unsafe-pattern refusal
            continue
        checked += 1
        for ch in DISPUTED:
            text = f"a{ch}b" if kind == "regex" else json.dumps(f"a{ch}b", ensure_ascii=False)
            if accepts(compiled, tokenizer, vocab, text):
                assert re.fullmatch(form, ch), (form, ch)
    assert checked >= (2 if kind == "json" and backend == "outlines" else len(CLASS_FORMS))


@pytest.mark.parametrize("m,texts", [
    (0.01, {"20": True, "19.99": False, "0.07": False, "0": True, "-3": True, "20.25": True,
            "0.50": True, "-1.75": True, "1230.55": False,
            # the shorter forms of multiples (json.dumps writes 10.5 and 10.0)
            "10.5": True, "10.0": True, "0.0": True, "-0.5": True, "19.9": False, "10.05": False,
            "10.500": False}),
    (0.1, {"3": True, "0.3": False, "0.7": False, "2.5": True, "0.25": False}),
    (0.3, {"3": True, "6": True, "0.9": False, "1": False, "1.5": True, "4.5": True}),
    (0.001, {"0.125": True, "2.375": True, "0.001": False, "0.250": True, "0.25": True,
             "0.5": True, "2.0": True, "0.1": False, "0.12": False}),
    (0.25, {"0.75": True, "1.25": True, "0.3": False, "0.5": True, "7.0": True, "7.50": True,
            "0.30": False}),
    (1.5, {"4.5": True, "3": True, "2": False}),
])
def test_decimal_multiple_of_keeps_to_what_jsonschema_passes(m, texts, compile_for, tokenizer,
                                                             vocab):
    """jsonschema checks a float multipleOf in binary floating point: 19.99 / 0.01 is
    1998.9999999999998, so a price the backend wrote (reading decimals) failed
    validation. Texts accepted exactly when jsonschema passes them or, for 0.01-like
    steps, when they are also multiples of the dyadic step that `float_multiple_of`
    keeps to (quarters for 0.01); walks validate and reach a fraction."""
    schema = {"type": "number", "multipleOf": m}
    name, compiled = compile_for(P(json=schema, whitespace="compact"))
    assert name == "llguidance"
    for text, expected in texts.items():
        assert accepts(compiled, tokenizer, vocab, text) == expected, text
        if expected:
            assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text
    outputs = list(_walk_outputs(compiled, vocab, random.Random(str(m))))
    for text in outputs:
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text
    if m != 0.3:                            # 1.5 and its multiples: fractions are rarer
        assert any(not float(json.loads(t)).is_integer() for t in outputs), outputs


@pytest.mark.parametrize("schema,texts", [
    ({"type": "number", "multipleOf": 0.25, "minimum": 0.5, "maximum": 10.75},
     {"0.5": True, "0.50": True, "10.5": True, "10.75": True, "10.0": True, "1": True,
      "0.25": False, "11.0": False, "11": False, "10.8": False, "0.0": False}),
    # a nullable price with an annotation the plain-node rewrites do not know
    ({"type": ["number", "null"], "multipleOf": 0.01, "example": "500.25"},
     {"null": True, "5.0": True, "8.25": True, "100.5": True, "5.1": False, "19.99": False,
      '"5"': False}),
    ({"type": ["string", "number"], "multipleOf": 0.01, "maxLength": 2},
     {'"ab"': True, '"abc"': False, "2.5": True, "2.50": True, "2.05": False}),
])
def test_shorter_forms_of_a_decimal_step_keep_the_node(schema, texts, compile_for, tokenizer,
                                                       vocab):
    """The branches that admit 10.5 and 10.0 under a quarter step carry the rest of
    the node: its bounds (and llguidance's bound truncations), its other types."""
    name, compiled = compile_for(P(json=schema, whitespace="compact"))
    assert name == "llguidance"
    judge(compiled, tokenizer, vocab, schema, texts)
    for text in _walk_outputs(compiled, vocab, random.Random(json.dumps(schema))):
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text


@pytest.mark.parametrize("schema,served", [
    ({"type": "number", "multipleOf": 0.07}, False),      # integers fail too: 0.07 * 100 ...
    ({"type": "number", "multipleOf": 0.01, "minimum": 0.51, "maximum": 0.74}, False),
    ({"type": "number", "multipleOf": 0.01, "exclusiveMinimum": 0.5, "exclusiveMaximum": 0.75},
     False),
    ({"type": "number", "multipleOf": 0.01, "minimum": 0.51, "maximum": 0.75}, True),
    ({"type": "number", "multipleOf": 0.01, "minimum": 0.5, "maximum": 1}, True),
])
def test_decimal_multiple_of_that_cannot_be_served_is_named(schema, served):
    if served:
        assert choose_backend(P(json=schema)) == "llguidance"
        return
    with pytest.raises(UnsupportedSchemaError) as info:
        choose_backend(P(json=schema))
    assert (info.value.issues[0].keyword, info.value.issues[0].path) == ("multipleOf", "$")


@pytest.mark.parametrize("m,texts", [
    # each False text was accepted before: llguidance checks multipleOf in u32
    # arithmetic and admits non-multiples from 9 fraction digits on
    (1e-10, {"6.7434229644": False, "43708.3125812553": False, "0.5": True, "0.00390625": True,
             "7": True}),
    (0.001953125, {"95.454078841": False, "50.131313585": False, "0.00390625": True, "3": True}),
    (2.5e-09, {"792.9025389701": False, "38.1990325173": False, "0.25": True}),
    (3e-10, {"5.648482921": False, "7372.4078479744": False, "0.01171875": True, "3": True}),
])
def test_a_step_of_nine_or_more_fraction_digits_is_coarsened(m, texts, compile_for, tokenizer,
                                                             vocab):
    """A step written in more than 8 fraction digits is served as its smallest
    multiple written in 8 or fewer (1/512 -> 1/256): sound, only stricter."""
    schema = {"type": "number", "multipleOf": m}
    name, compiled = compile_for(P(json=schema, whitespace="compact"))
    assert name == "llguidance"
    judge(compiled, tokenizer, vocab, schema, texts)
    outputs = list(_walk_outputs(compiled, vocab, random.Random(repr(m))))
    for text in outputs:
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text


@pytest.mark.parametrize("m", [0.01, 0.1, 0.05, 0.3, 0.001, 1e-06, 0.07, 0.7, 1e-05, 0.02, 1.1,
                               1e-10, 3e-10, 0.001953125, 1e-12])
def test_float_multiple_of_claim(m):
    """Where float_multiple_of narrows the step, jsonschema's own test passes every
    multiple of it (200,000 near zero, 20,000 past 2^50, where floats thin out) and
    for an integer node every integer multiple; where it refuses, some integer fails."""
    from formwork.grammar.schema_formats import float_multiple_of
    narrowed = float_multiple_of({"type": "number", "multipleOf": m})

    def passes(v):                          # jsonschema's multipleOf for a float step
        return int(v / m) == v / m
    if narrowed is None:
        assert float_multiple_of({"type": "integer", "multipleOf": m}) is None
        assert not all(passes(j) for j in range(1, 200_000))
        return
    step = Fraction(narrowed["multipleOf"])
    decimal = Fraction(repr(m))
    assert step.denominator & (step.denominator - 1) == 0           # dyadic: floats say it
    assert step.denominator <= 2 ** 8                                # 8 fraction digits at most
    assert (step / decimal).denominator == 1                        # a decimal multiple
    assert all(passes(float(j * step)) for j in range(-100_000, 100_000))
    far = 2 ** 50 // step.numerator * step.numerator
    assert all(passes(float(far + j * step)) for j in range(-10_000, 10_000))
    integer = float_multiple_of({"type": "integer", "multipleOf": m})
    assert integer["type"] == "integer" and isinstance(integer["multipleOf"], int)
    assert all(passes(j * integer["multipleOf"]) for j in range(-100_000, 100_000))
    # and the decimal multiples off the step: some fail (where m is not a float exactly)
    if Fraction(m) != decimal:
        assert not all(passes(float(k * decimal)) for k in range(1, 2000))


def test_a_top_level_alternation_pattern_is_served_by_auto(compile_for, tokenizer, vocab):
    """The same pattern under `auto` (llguidance): every walk output is JSON and valid."""
    schema = {"type": "object", "properties": {"scope": {"type": "string", "pattern": "^all|tags$"}},
              "required": ["scope"]}
    name, compiled = compile_for(P(json=schema, whitespace="compact"))
    assert name == "llguidance"
    judge(compiled, tokenizer, vocab, schema, {'{"scope":"all"}': True, '{"scope":"tags"}': True,
                                               '{"scope":"all of it"}': True, '{"scope":"my tags"}': True,
                                               '{"scope":"none"}': False, '{"scope":"tags!"}': False})
    for text in _walk_outputs(compiled, vocab, random.Random("alt")):
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text


NAME_FORMS = ["\\d", "\\D", "\\w", "\\W", "\\s", "\\S", "[^\\s]", "[\\S]", "."]


@pytest.mark.parametrize("backend,mode", [("llguidance", "declared"), ("llguidance", "schema"),
                                          ("auto", "declared")])
@pytest.mark.parametrize("extra", [False, {"type": "string"}, None])
def test_pattern_property_names_are_read_as_python_reads_them(backend, mode, extra, compile_for,
                                                              tokenizer, vocab):
    """A patternProperties name is a regex too: for `^k\\D$` xgrammar and llguidance
    wrote the key "k١" (Python: ١ is a digit, so the key matched no pattern and
    `additionalProperties: false` refused it); for `^k\\d$` next to an open object
    llguidance wrote "k١" as an undeclared key with a string value (Python: it
    matches the pattern, whose schema wants an integer). 120 such acceptances over
    these forms before; now a key is accepted only where jsonschema agrees, and
    the ASCII keys each pattern means are still served. (xgrammar refuses
    patternProperties now: test_xgrammar_refuses_pattern_property_names.)"""
    ascii_key = {"\\d": "1", "\\D": "a", "\\w": "a", "\\W": "-", "\\s": " ", "\\S": "a",
                 "[^\\s]": "a", "[\\S]": "a", ".": "a"}
    for form in NAME_FORMS:
        schema = {"type": "object", "patternProperties": {f"^k{form}$": {"type": "integer"}}}
        if extra is not None:
            schema["additionalProperties"] = extra
        _, compiled = compile_for(P(json=schema, backend=backend, additional_properties=mode))
        assert accepts(compiled, tokenizer, vocab, json.dumps({"k" + ascii_key[form]: 1})), form
        for ch in DISPUTED + ["\x1f", "\u180e"]:
            for value in ("1", '"s"'):
                text = "{" + json.dumps("k" + ch, ensure_ascii=False) + ": " + value + "}"
                if accepts(compiled, tokenizer, vocab, text):
                    valid = jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
                    assert valid, (form, ch, value)


def test_pattern_property_names_closed_keep_required_names(compile_for, tokenizer, vocab):
    """Closing an object whose pattern names were narrowed declares its undeclared
    required names with the additionalProperties schema, so it stays satisfiable."""
    schema = {"type": "object", "patternProperties": {"^n\\d+$": {"type": "integer"}},
              "additionalProperties": {"type": "string"}, "required": ["id"]}
    _, compiled = compile_for(P(json=schema, backend="llguidance", additional_properties="schema"))
    judge(compiled, tokenizer, vocab, schema, {'{"id": "x"}': True, '{"id": "x", "n12": 3}': True,
                                               '{"id": 3}': False, '{"n1": 3}': False})
    for text in _walk_outputs(compiled, vocab, random.Random("req")):
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text


@pytest.mark.parametrize("backend", ["auto", "llguidance", "xgrammar"])
@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"ké": {"type": "string"}},       # 'ké' matches ^k\w$ in re
     "patternProperties": {"^k\\w$": {"type": "string", "maxLength": 3}}},
    {"type": "object", "patternProperties": {"^k\\d$": {"type": "integer"}},
     "allOf": [{"properties": {"z": {"type": "string"}}}]},
])
def test_pattern_property_names_that_cannot_be_read_alike_are_named(schema, backend):
    with pytest.raises(UnsupportedSchemaError) as info:
        choose_backend(P(json=schema, backend=backend, additional_properties="declared"))
    assert "patternProperties" in {i.keyword for i in info.value.issues}


def test_pattern_property_names_beside_a_mergeable_all_of_are_served(compile_for, tokenizer,
                                                                      vocab):
    """allOf beside a narrowed pattern name is refused as written; where formwork
    merges it into the node, the merged node is closed and served."""
    schema = {"type": "object", "patternProperties": {"^k\\d$": {"type": "integer"}},
              "allOf": [{"required": ["k1"]}]}
    name, compiled = compile_for(P(json=schema))
    assert name == "llguidance"
    judge(compiled, tokenizer, vocab, schema, {'{"k1": 1}': True, '{"k1": 1, "k2": 2}': True,
                                               '{"k2": 2}': False, '{"k1": "x"}': False})
    assert not accepts(compiled, tokenizer, vocab, '{"k1": 1, "k\u0661": "x"}')


SURROGATE_TEXTS = {'"\\ud800"': False, '"a\\udc00b"': False, '"\\uD83D\\uDE00"': False,
                   '"\\ud83d\\u0041"': False, '"\\\\ud800"': True, '"\\u00e9\\u0000"': True,
                   '"\\ud7ff"': True, '"\\ue000"': True, '"😀"': True}


@pytest.mark.parametrize("backend", ["auto", "llguidance", "xgrammar"])
def test_no_surrogate_escape_in_json(backend, compile_for, tokenizer, vocab):
    """xgrammar's JSON strings took `"\\ud800"`, a lone surrogate: Python's json
    decodes it into a str that cannot be encoded as UTF-8 and pydantic's parser
    refuses the text. No backend writes a surrogate escape now (an escaped
    backslash before `ud800` is text, and stays allowed)."""
    import pydantic_core
    for schema in ({"type": "string"}, {"type": "object", "properties": {"a": {"type": "string"}},
                                         "required": ["a"]}):
        _, compiled = compile_for(P(json=schema, backend=backend))
        for text, allowed in SURROGATE_TEXTS.items():
            doc = text if schema["type"] == "string" else '{"a": ' + text + '}'
            got = accepts(compiled, tokenizer, vocab, doc)
            if backend == "xgrammar" or not allowed:     # the others refuse \u escapes but controls
                assert got == allowed, doc
            if got:
                pydantic_core.from_json(doc)
                json.dumps(json.loads(doc), ensure_ascii=False).encode()


def test_no_surrogate_escape_in_xgrammar_tool_calls(compile_for, tokenizer, vocab):
    """Tools in `auto` mode are xgrammar structural tags first: the same guard."""
    begin, end = '<tool_call>{"name": "say", "arguments": ', "}</tool_call>"
    tag = {"triggers": ["<tool_call>"], "structures": [
        {"begin": begin, "schema": {"type": "object", "properties": {"t": {"type": "string"}},
                                    "required": ["t"]}, "end": end}]}
    name, compiled = compile_for(P(structural_tag=tag))
    assert name == "xgrammar"
    for text, allowed in SURROGATE_TEXTS.items():
        call = begin + '{"t": ' + text + "}" + end
        assert accepts(compiled, tokenizer, vocab, "Sure. " + call) == allowed, text
    # a regex is not JSON: its backslashes are the user's to spell
    _, compiled = compile_for(P(regex="\\\\ud800", backend="xgrammar"))
    assert accepts(compiled, tokenizer, vocab, "\\ud800")


def test_surrogate_escape_guard_mask_matches_accept(compile_for, tokenizer, vocab):
    """After `"\\u` and after `"\\ud` the mask allows exactly the tokens
    accept_tokens takes (no surrogate second digit), and walks stay parseable."""
    _, compiled = compile_for(P(json={"type": "string"}, backend="xgrammar"))
    bitmask = allocate_bitmask(1, VOCAB)
    for prefix in ('"\\u', '"\\ud', '"\\uD', '"x\\\\'):
        m = compiled.new_matcher()
        assert m.accept_tokens(tokenizer.encode(prefix, add_special_tokens=False)), prefix
        m.fill_bitmask(bitmask, 0)
        allowed = set(allowed_token_ids(bitmask, 0, VOCAB))
        for tid in range(VOCAB):
            if vocab.token_bytes[tid]:
                ok = m.accept_tokens([tid])
                if ok:
                    m.rollback(1)
                assert ok == (tid in allowed), (prefix, vocab.token_bytes[tid])
    for text in _walk_outputs(compiled, vocab, random.Random("esc"), steps=64):
        pydantic_core_ok = __import__("pydantic_core").from_json(text)
        assert isinstance(pydantic_core_ok, str)


def test_xgrammar_refuses_pattern_property_names(compile_for, tokenizer, vocab):
    """xgrammar compiles a patternProperties name with the loose converter it uses
    for `pattern` (a held-out xAPI language map: 3 walk outputs with names such as
    "rolysisALLYtry9"; minimal: ^a(bc+)?$ admitted "acc"). Refused naming it;
    `auto` serves it with llguidance, exactly."""
    schema = {"type": "object", "additionalProperties": False,
              "patternProperties": {"^a(bc+)?$": {"type": "string"}}}
    with pytest.raises(UnsupportedSchemaError) as info:
        choose_backend(P(json=schema, backend="xgrammar"))
    assert (info.value.issues[0].keyword, info.value.issues[0].path) == ("patternProperties", "$")
    name, compiled = compile_for(P(json=schema))
    assert name == "llguidance"
    judge(compiled, tokenizer, vocab, schema, {'{"a": "x"}': True, '{"abcc": "x"}': True,
                                               '{"acc": "x"}': False, '{"ab": "x"}': False})


@pytest.mark.parametrize("backend", ["llguidance", "outlines"])
@pytest.mark.parametrize("kind", ["regex", "json"])
def test_posix_class_syntax_means_what_python_reads(backend, kind, compile_for, tokenizer, vocab):
    """`[[:alpha:]]+` is the set `[:alph` then `]+` to ECMA-262 and Python; llguidance
    and outlines-core read a POSIX letter class, and walks wrote "Wow"."""
    texts = {"a]": True, ":]]": True, "Wow": False}
    params = P(regex="[[:alpha:]]+", backend=backend) if kind == "regex" else \
        P(json={"type": "string", "pattern": "^[[:alpha:]]+$"}, backend=backend)
    try:
        _, compiled = compile_for(params)
    except UnsupportedSchemaError:
        assert backend == "outlines" and kind == "json"          # may match a quote: refused
        return
    for text, expected in texts.items():
        doc = text if kind == "regex" else json.dumps(text)
        assert accepts(compiled, tokenizer, vocab, doc) == expected, text


NUMERIC_BOUNDS = [   # (schema, {text: accepted}); every accepted text validates
    ({"type": "number", "exclusiveMaximum": 1},
     {"0.99999999999999999999": False, "0.9999999999999999": False, "0.99": True, "1": False}),
    ({"type": "number", "exclusiveMinimum": 0},
     {"0." + "0" * 330 + "1": False, "1e-400": False, "0.5": True, "0": False}),
    ({"type": "number", "exclusiveMaximum": 0.1}, {"0.09999999999999999999": False, "0.09": True}),
    ({"type": "number", "maximum": 0.19999999999999998},
     {"0.199999999999999981": False, "0.19999999999999999": False, "0.1999": True}),
    ({"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 1},
     {"-0.99999999999999999999": False, "-0.5": True, "0.5": True}),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "maximum": 1,
      "exclusiveMaximum": True}, {"0.99999999999999999999": False, "0.5": True, "1": False}),
    # llguidance 1.9's range regex refused the bound's truncations: 0.9 under 0.95
    ({"type": "number", "maximum": 0.95}, {"0.9": True, "0.94": True, "0.96": False}),
    ({"type": "number", "minimum": -0.95}, {"-0.9": True, "-0.96": False}),
    ({"type": "number", "minimum": 10, "maximum": 10.25}, {"10.2": True, "10": True, "10.3": False}),
    ({"type": "number", "exclusiveMaximum": 100}, {"99.9": True, "99.99": True, "100": False}),
]


@pytest.mark.parametrize("schema,texts", NUMERIC_BOUNDS)
def test_numeric_bounds_hold_as_jsonschema_reads_floats(schema, texts, compile_for, tokenizer,
                                                        vocab):
    """llguidance reads a number as the decimal written, jsonschema as a binary float:
    0.99999999999999999999 is below 1 as a decimal and 1.0 as a float, so it passed
    the mask under `exclusiveMaximum: 1` and failed validation; and llguidance
    rounded bounds of 16+ significant digits (`maximum: 0.19999999999999998`
    admitted 0.199999999999999981). Bounds are now 15-digit inclusive ones inside,
    and the numbers llguidance's range regex refused under a bound with fraction
    digits (0.9 under `maximum: 0.95`) are served."""
    name, compiled = compile_for(P(json=schema))
    assert name == "llguidance"
    cls = jsonschema.validators.validator_for(schema)
    for text, expected in texts.items():
        assert accepts(compiled, tokenizer, vocab, text) == expected, text
        if expected:
            assert cls(schema).is_valid(json.loads(text)), text
    for text in _walk_outputs(compiled, vocab, random.Random(json.dumps(schema)), steps=40):
        assert cls(schema).is_valid(json.loads(text)), text


def test_float_safe_bounds_claim():
    """For bounds of every size, decimals at the new bound and just past the old one:
    what the new bound admits reads (as a float) inside the old one."""
    from decimal import Decimal
    from formwork.grammar.schema_formats import float_safe_bounds
    rng = random.Random(7)
    for _ in range(3000):
        b = rng.choice([0, 1, -1, 0.1, 100]) if rng.random() < 0.2 else \
            rng.uniform(-1, 1) * 10 ** rng.randint(-30, 30)
        for kw, op in (("exclusiveMaximum", float.__lt__), ("maximum", float.__le__),
                       ("exclusiveMinimum", float.__gt__), ("minimum", float.__ge__)):
            node = float_safe_bounds({"type": "number", kw: b})
            new_kw = "maximum" if "aximum" in kw else "minimum"
            new = Decimal(repr(node[new_kw]))
            assert len(new.normalize().as_tuple().digits) <= 15
            for d in (new, new + (Decimal(-1) if new_kw == "maximum" else 1) * abs(new) / 10**20):
                assert op(float(d), float(b)), (kw, b, d)


@pytest.mark.parametrize("schema,served", [
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, False),
    ({"type": "object", "patternProperties": {"^k\\d$": {"type": "integer"}},
      "additionalProperties": False, "minProperties": 2}, False),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1}, True),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "required": ["a", "b"],
      "additionalProperties": {"type": "integer"}, "minProperties": 2}, True),
])
@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_min_properties_not_made_up_by_a_repeated_name(schema, served, backend, compile_for,
                                                       tokenizer, vocab):
    """The backends do not keep generated names apart: `{"a": 1, "a": 2}` passed
    `minProperties: 2` in the mask (llguidance and xgrammar), and jsonschema sees
    one name. Refused where undeclared or patterned names could make up a count of
    2 or more; served where the count is 1 or required declared names make it."""
    params = P(json=schema, backend=backend)
    if backend == "xgrammar" and "patternProperties" in schema:
        served = False
    if not served:
        with pytest.raises(UnsupportedSchemaError) as info:
            compile_for(params)
        assert {i.keyword for i in info.value.issues} & {"minProperties", "patternProperties"}
        return
    _, compiled = compile_for(params)
    for text in ('{"x": 1, "x": 2}', '{"a": 1, "b": 2}', '{"a": 1, "b": 2, "x": 3}'):
        if accepts(compiled, tokenizer, vocab, text):
            assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text


def test_min_properties_inside_a_condition_is_not_blamed():
    """An `if` is tested, never generated from: its minProperties is no reason to
    refuse, and formwork's own refusal no longer stops the rewrites from being
    tried (a held-out TSON schema was refused for a minProperties inside an `if`;
    it is refused for what llguidance lacks)."""
    schema = {"type": "object", "properties": {"kind": {"type": "string"}, "n": {"type": "integer"}},
              "if": {"properties": {"kind": {"const": "a"}}, "minProperties": 2,
                     "additionalProperties": {"type": "integer"}},
              "then": {"required": ["n"]}}
    with pytest.raises(UnsupportedSchemaError) as info:
        choose_backend(P(json=schema))
    assert "minProperties" not in {i.keyword for i in info.value.issues}
    assert "if" in {i.keyword for i in info.value.issues}


# --- number ranges at the ends of 64 bits, and ranges that hold nothing ---------------------

LOW = -2 ** 63


@pytest.mark.parametrize("schema,texts", [
    # llguidance 1.9 crashed the process (SIGSEGV) building these: the gateway's check
    # took the server down; now xgrammar serves them
    ({"type": "integer", "minimum": LOW, "maximum": LOW + 8},
     {str(LOW): True, str(LOW + 8): True, str(LOW + 9): False, "0": False}),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": LOW + 1,
                                             "maximum": LOW + 100}}, "required": ["n"]},
     {f'{{"n":{LOW + 50}}}': True, f'{{"n":{LOW}}}': False, '{"n":5}': False}),
])
def test_int64_floor_ranges_are_served_without_llguidance(schema, texts, compile_for, tokenizer,
                                                          vocab):
    name, compiled = compile_for(P(json=schema, whitespace="compact"))
    assert name == "xgrammar"
    judge(compiled, tokenizer, vocab, schema, texts)
    for text in _walk_outputs(compiled, vocab, random.Random(json.dumps(schema))):
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text
    with pytest.raises(UnsupportedSchemaError, match="'maximum' at") as info:
        choose_backend(P(json=schema, backend="llguidance"))
    assert "-2^63 + 1024" in str(info.value)


@pytest.mark.parametrize("schema,keyword", [
    # read as int64, the minimum became 2^63 - 1: every output was below it
    ({"type": "integer", "minimum": 2 ** 63, "maximum": 2 ** 63 + 5}, "minimum"),
    ({"type": "integer", "exclusiveMinimum": 2 ** 63 - 1}, "exclusiveMinimum"),
    # past 64 bits llguidance's reader raised "Value is not JSON serializable" (no keyword)
    ({"type": "object", "properties": {"v": {"type": "integer", "minimum": 2 ** 64}}},
     "minimum"),
])
def test_bounds_llguidance_reads_wrongly_are_refused_by_name(schema, keyword):
    with pytest.raises(UnsupportedSchemaError) as info:
        choose_backend(P(json=schema, backend="llguidance"))
    issue = info.value.issues[0]
    assert issue.keyword == keyword
    assert issue.path == ("$.properties.v" if "properties" in schema else "$")


@pytest.mark.parametrize("schema,empty", [
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 5e-324}, True),  # no double
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-323}, False),
    ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, True),
    ({"type": "integer", "minimum": 1.5, "maximum": 1.7}, True),
    ({"type": "number", "minimum": 1.5, "maximum": 1.7}, False),
    ({"type": "number", "exclusiveMinimum": 0.1, "maximum": 0.1}, True),
    ({"type": "number", "minimum": 10 ** 400}, False),          # one bound only: not judged here
    ({"type": "number", "minimum": 10 ** 400, "maximum": 10 ** 401}, True),
    ({"type": ["integer", "null"], "exclusiveMinimum": 1, "exclusiveMaximum": 2}, False),
])
def test_number_ranges_that_hold_nothing_are_refused(schema, empty):
    """xgrammar built a rule for `exclusiveMinimum: 0, exclusiveMaximum: 5e-324` that
    matched the empty text: outputs that were not JSON. A range no value of the
    node's type meets is refused for every backend, naming where."""
    from formwork.grammar.schema_check import check_bounds
    if not empty:
        check_bounds(schema)
        return
    with pytest.raises(ValueError, match=r"at \$: .* lies between them"):
        check_bounds(schema)
    for backend in ("auto", "xgrammar", "llguidance"):
        with pytest.raises(ValueError, match="lies between them"):
            choose_backend(P(json=schema, backend=backend))


@pytest.mark.parametrize("schema,empty", [
    # llguidance found no multiple of 2.5 among the integers [2^53, 2^53] only at the
    # first decoding step: the request failed in flight ("NoExtensionBias")
    ({"type": "integer", "minimum": 2 ** 53, "maximum": 2 ** 53, "multipleOf": 2.5}, True),
    ({"type": "integer", "minimum": 2 ** 53 - 2, "maximum": 2 ** 53, "multipleOf": 2.5}, False),
    # llguidance refused these naming `type`
    ({"type": "integer", "minimum": 3, "maximum": 4, "multipleOf": 5}, True),
    ({"type": "number", "minimum": 0.1, "maximum": 0.2, "multipleOf": 1}, True),
    ({"type": "integer", "minimum": 3, "exclusiveMaximum": 5, "multipleOf": 5}, True),
    ({"type": "integer", "minimum": 3, "maximum": 5, "multipleOf": 5}, False),
    ({"type": "number", "minimum": 0.1, "maximum": 0.2, "multipleOf": 0.1}, False),
    ({"type": "number", "exclusiveMinimum": 0.1, "exclusiveMaximum": 0.2, "multipleOf": 0.1}, True),
    ({"type": "number", "minimum": 0.3, "maximum": 0.3, "multipleOf": 0.1}, False),
    ({"type": "integer", "minimum": 1, "maximum": 2, "multipleOf": 0.5}, False),
    ({"type": "integer", "multipleOf": 0.3, "minimum": 1, "maximum": 2}, True),    # step 3
    ({"type": "number", "minimum": -7, "maximum": -6, "multipleOf": 5}, True),
    ({"type": "number", "minimum": -10, "maximum": -6, "multipleOf": 5}, False),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "minimum": 0,
      "exclusiveMinimum": True, "maximum": 5, "exclusiveMaximum": True, "multipleOf": 5}, True),
    ({"type": "number", "minimum": 7, "multipleOf": 5}, False),        # one bound: always some
    ({"minimum": 3, "maximum": 4, "multipleOf": 5}, False),            # untyped: "a" passes
    ({"type": ["integer", "string"], "minimum": 3, "maximum": 4, "multipleOf": 5}, False),
])
def test_ranges_without_a_multiple_are_refused_naming_multipleof(schema, empty):
    """A bounded number whose `multipleOf` has no multiple between the bounds is a 400
    before anything runs, naming the keyword; jsonschema agrees that no value of the
    node's type in the range passes (checked at the few candidates around the bounds)."""
    from formwork.grammar.schema_check import check_bounds
    if not empty:
        check_bounds(schema)
        return
    lo = schema.get("minimum", schema.get("exclusiveMinimum"))
    if abs(lo) < 1e6 and "$schema" not in schema:    # (2^53 / 2.5 rounds to an integer in
        candidates = [lo + d / 10 for d in range(-30, 31)]          # jsonschema's floats)
        assert not [v for v in candidates if jsonschema.Draft202012Validator(schema).is_valid(v)]
    with pytest.raises(ValueError, match=r"at \$: multipleOf .*no (integer|number) between"):
        check_bounds(schema)
    for backend in ("auto", "xgrammar", "llguidance", "outlines"):
        with pytest.raises(ValueError, match="multipleOf"):
            choose_backend(P(json=schema, backend=backend))


@pytest.mark.parametrize("fmt,bits", [("int32", 31), ("int64", 63)])
def test_openapi_integer_formats_keep_to_their_width(fmt, bits, compile_for, tokenizer, vocab):
    """`format: int64` annotates only (no draft defines it), and a model wrote 30
    digits under it; OpenAPI's integer widths are generated as ranges (stricter)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "format": fmt}},
              "required": ["n"]}
    name, compiled = compile_for(P(json=schema, whitespace="compact"))
    assert name == "llguidance"
    for n, inside in ((2 ** bits - 1, True), (2 ** bits, False), (-2 ** bits + 2048, True),
                      (-2 ** bits - 1, False), (10 ** 29, False), (7, True)):
        assert accepts(compiled, tokenizer, vocab, f'{{"n":{n}}}') == inside, n
    for text in _walk_outputs(compiled, vocab, random.Random(fmt)):
        n = json.loads(text)["n"]
        assert -2 ** bits <= n < 2 ** bits, text


def test_pydantic_uuid_and_ip_formats_are_served_as_pydantic_reads_them(compile_for, tokenizer,
                                                                        vocab):
    """pydantic writes `UUID4` as {"format": "uuid4"} and `IPvAnyAddress` as
    {"format": "ipvanyaddress"}: no draft defines them, so they annotated only, and
    model_validate_json refused every walk output (40 of 40: "({} expose" for an
    address). They are served as what pydantic's validators take (stricter)."""
    from typing import Optional

    from pydantic import UUID1, UUID4, BaseModel, IPvAnyAddress

    class Host(BaseModel):
        id: UUID4
        boot: UUID1
        ip: IPvAnyAddress
        gateway: Optional[IPvAnyAddress] = None

    schema = Host.model_json_schema()
    name, compiled = compile_for(P(json=schema, whitespace="compact"))
    assert name == "llguidance"

    def text(id_="0b0c6c1e-2f8a-4d3b-9a1e-3c5e7f9a1b2c",
             boot="c232ab00-9414-11ec-b3c8-9f6bdeced846", ip="10.0.0.1"):
        return json.dumps({"id": id_, "boot": boot, "ip": ip}, separators=(",", ":"))
    for t, ok in ((text(), True), (text(ip="::1"), True), (text(ip="fe80::1:2"), True),
                  (text(ip="999.1.1.1"), False), (text(ip="({} expose"), False),
                  (text(id_="0b0c6c1e-2f8a-1d3b-9a1e-3c5e7f9a1b2c"), False),     # version 1
                  (text(id_="0b0c6c1e-2f8a-4d3b-7a1e-3c5e7f9a1b2c"), False),     # NCS variant
                  (text(boot="c232ab00-9414-41ec-b3c8-9f6bdeced846"), False)):
        assert accepts(compiled, tokenizer, vocab, t) == ok, t
        if ok:
            Host.model_validate_json(t)
    outs = list(_walk_outputs(compiled, vocab, random.Random(4), steps=200))
    assert outs
    for out in outs:
        Host.model_validate_json(out)
        jsonschema.Draft202012Validator(schema).validate(json.loads(out))


@pytest.mark.parametrize("schema,keyword,path", [
    ({"enum": []}, "enum", "$"),
    ({"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]}, "enum",
     "$.properties.a"),
    ({"type": "array", "items": {"enum": []}, "minItems": 1}, "enum", "$.items"),
    ({"const": 1, "enum": [2]}, "const", "$"),
    ({"const": 1, "enum": [1, 2]}, "const", "$"),   # one backend keeps const, another enum
])
@pytest.mark.parametrize("backend", ALL)
def test_enum_and_const_a_backend_would_drop_are_refused(schema, keyword, path, backend):
    """outlines-core served `enum: []` (at the root, a required property, the items
    of a non-empty array) with rules that matched the empty text, `{"a": }` and
    `[]`; given `const` beside `enum`, xgrammar wrote the const and outlines-core
    an enum value, each failing the other. Such a node is now refused (llguidance
    calls it unsatisfiable, and the refusal names the node, not what it made
    unmeetable: `required` at $) or served where every value it writes passes both."""
    if schema == {"const": 1, "enum": [1, 2]} and backend in ("auto", "llguidance"):
        return        # llguidance keeps both: served, checked below
    with pytest.raises(UnsupportedSchemaError) as err:
        choose_backend(P(json=schema, backend=backend))
    if backend in ("auto", "llguidance", "outlines"):
        assert (err.value.issues[0].keyword, err.value.issues[0].path) == (keyword, path)


@pytest.mark.parametrize("schema,texts", [
    ({"const": 1, "enum": [1, 2]}, {"1": True, "2": False}),
    ({"const": "a", "enum": ["a"]}, {'"a"': True, '"b"': False}),
    ({"type": "object", "properties": {"a": {"enum": []}, "b": {"type": "integer"}},
      "required": ["b"]}, {'{"b": 1}': True, '{"a": 1, "b": 1}': False}),
])
@pytest.mark.parametrize("backend", ALL)
def test_enum_and_const_served_keep_to_both(schema, texts, backend, compile_for, tokenizer,
                                            vocab):
    try:
        _, compiled = compile_for(P(json=schema, backend=backend))
    except UnsupportedSchemaError:
        assert backend in ("xgrammar", "outlines") and "const" in schema
        return
    judge(compiled, tokenizer, vocab, schema, texts)


# enum/const numbers llguidance and outlines-core read as 64-bit floats and write back
# as other numbers (found by random schemas, 2026-12-07; grammar/schema_values.py)
INEXACT = [
    (0.9619009378982257, ("llguidance", "outlines")),     # written ...256 by both
    (123456789.12345679, ("llguidance", "outlines")),
    (9007199254740993, ("llguidance",)),                  # written 9007199254740992
    (1e23, ("llguidance",)),                              # written as the integer 10**23
]


@pytest.mark.parametrize("value,wrong", INEXACT)
@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("keyword", ["enum", "const"])
def test_enum_numbers_are_written_as_themselves(value, wrong, backend, keyword, compile_for,
                                                tokenizer, vocab):
    """A backend that would write an enum/const number as another one is refused
    naming the keyword (auto then serves the schema with xgrammar, which writes the
    schema's own text); whatever is served writes only values jsonschema passes."""
    inner = {"enum": [value, "a"]} if keyword == "enum" else {"const": value}
    schema = {"type": "object", "properties": {"v": inner}, "required": ["v"],
              "additionalProperties": False}
    params = P(json=schema, whitespace="compact", backend=backend)
    if backend in wrong:
        with pytest.raises(UnsupportedSchemaError) as err:
            compile_for(params)
        assert (err.value.issues[0].keyword, err.value.issues[0].path) == \
            (keyword, "$.properties.v")
        assert json.dumps(value) in str(err.value)
        return
    name, compiled = compile_for(params)
    assert backend != "auto" or name == ("xgrammar" if "llguidance" in wrong else "llguidance")
    outputs = list(_walk_outputs(compiled, vocab, random.Random(repr(value))))
    assert outputs
    for text in outputs:
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text
    if keyword == "const":
        assert accepts(compiled, tokenizer, vocab, json.dumps({"v": value}, separators=(",", ":")))


@pytest.mark.parametrize("value", [1e20, -1e19, 3e19])
def test_integer_typed_enum_values_past_int64_are_refused_by_llguidance(value, compile_for,
                                                                          tokenizer, vocab):
    """Beside `type: integer` llguidance reads an enum value as a 64-bit integer: 1e20
    was written 9223372036854775807, and a value below -2^63 crashed the process
    (SIGSEGV) building it. Refused without building it; auto serves xgrammar."""
    schema = {"enum": [value, 2], "type": "integer"}
    with pytest.raises(UnsupportedSchemaError) as err:
        compile_for(P(json=schema, backend="llguidance"))
    assert (err.value.issues[0].keyword, err.value.issues[0].path) == ("enum", "$")
    name, compiled = compile_for(P(json=schema, whitespace="compact"))
    assert name == "xgrammar"
    judge(compiled, tokenizer, vocab, schema, {"2": True, "9223372036854775807": False})
    for text in _walk_outputs(compiled, vocab, random.Random(repr(value))):
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text


def test_integer_typed_enum_values_inside_int64_stay_on_llguidance(compile_for, tokenizer, vocab):
    schema = {"enum": [-4e18, 2.0, 0.5], "type": "integer"}    # 0.5: no integer, dropped
    name, compiled = compile_for(P(json=schema, whitespace="compact"))
    assert name == "llguidance"
    judge(compiled, tokenizer, vocab, schema, {"-4000000000000000000": True, "2": True,
                                               "0.5": False, "9223372036854775807": False})


@pytest.mark.parametrize("backend", ["auto", "llguidance", "xgrammar", "outlines"])
def test_special_token_text_inside_keys_and_values(backend, compile_for, tokenizer, vocab):
    """A key or enum value spelling a special token (`<|im_end|>`): the model must write
    that text with ordinary tokens. llguidance tokenized the forced key with the
    tokenizer's `encode`, which turns the spelling into the special token, so its mask
    allowed that token alone and the matcher then refused it: the request failed
    ("grammar rejected token"). Every backend now serves it; no special token appears."""
    from formwork.grammar.vocab import PlainEncoder

    schema = {"type": "object", "properties": {
        "<|im_end|>": {"type": "integer"},
        "tag": {"enum": ["<|im_start|>x", "</tool_call>", "<|endoftext|>"]}},
        "required": ["<|im_end|>", "tag"], "additionalProperties": False}
    _, compiled = compile_for(P(json=schema, whitespace="compact", backend=backend))
    encode = PlainEncoder(tokenizer, vocab)
    text = '{"<|im_end|>":3,"tag":"<|endoftext|>"}'
    m = compiled.new_matcher()
    assert m.accept_tokens(encode(text)) and m.accept_tokens([vocab.eos_token_id])
    outputs = list(_walk_outputs(compiled, vocab, random.Random(backend)))
    assert len(outputs) >= 6
    for text in outputs:
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text


def test_plain_encoder_spells_special_token_text(tokenizer, vocab):
    from formwork.grammar.vocab import PlainEncoder

    encode = PlainEncoder(tokenizer, vocab)
    text = 'a<|im_end|>b<|endoftext|>'
    ids = encode(text)
    assert all(vocab.token_bytes[i] is not None for i in ids)
    assert b"".join(vocab.token_bytes[i] for i in ids) == text.encode()
    assert encode("plain text") == tokenizer.encode("plain text", add_special_tokens=False)


@pytest.mark.parametrize("schema,keyword,texts", [
    # it kept the pattern and dropped the format: "áâöûô" for a uuid
    ({"type": "string", "pattern": "^[a-f0-9-]+$", "format": "uuid"}, "format",
     {'"xyz"': False, '"123e4567-e89b-12d3-a456-426614174000"': True}),
    # beside prefixItems it wrote exactly the prefix: [1] under minItems 2
    ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2}, "minItems",
     {"[1]": False, "[1,2]": True, "[1,\"a\"]": True}),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "integer"}],
      "maxItems": 1}, "maxItems", {"[1,2]": False, "[1]": True}),
    # its any-value regex unparenthesized inside the array: "abc" passed at the root
    ({"type": "array", "prefixItems": [{"$ref": "#/$defs/any"}, {"const": 3}],
      "$defs": {"any": {}}}, "prefixItems", {'"abc"': False, "[1,3]": True, '["a",3]': True}),
])
def test_outlines_refuses_keywords_its_regex_drops(schema, keyword, texts, compile_for,
                                                   tokenizer, vocab):
    with pytest.raises(UnsupportedSchemaError) as err:
        compile_for(P(json=schema, backend="outlines"))
    assert (err.value.issues[0].keyword, err.value.issues[0].path) == (keyword, "$")
    name, compiled = compile_for(P(json=schema, whitespace="compact"))
    assert name == "llguidance"
    judge(compiled, tokenizer, vocab, schema, texts)
    checked = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    for text in _walk_outputs(compiled, vocab, random.Random(keyword)):
        assert checked.is_valid(json.loads(text)), text


@pytest.mark.parametrize("schema,texts,served", [
    # read as floats, the bounds became ...992 (below the minimum) and ...680 (above)
    ({"type": "integer", "minimum": 9007199254740993, "maximum": 123456789012345678},
     {"9007199254740993": True, "9007199254740992": False, "123456789012345680": False,
      "123456789012345664": True}, "llguidance"),
    ({"type": "integer", "exclusiveMinimum": 9007199254740993, "exclusiveMaximum": 2.0 ** 60},
     {"9007199254740993": False, "9007199254740994": True, "1152921504606846976": False},
     "llguidance"),
    # a range no float-held integer lies in: llguidance refuses, xgrammar reads it exactly
    ({"type": "integer", "minimum": 9007199254740995, "maximum": 9007199254740995},
     {"9007199254740995": True, "9007199254740996": False}, "xgrammar"),
])
def test_integer_bounds_past_two_to_the_53(schema, texts, served, compile_for, tokenizer, vocab):
    """llguidance reads an integer bound as a 64-bit float (random schemas,
    2026-12-07): bounds past 2^53 are served as the nearest float-held integers
    inside them, only stricter."""
    name, compiled = compile_for(P(json=schema, whitespace="compact"))
    assert name == served
    sure = {t: ok for t, ok in texts.items() if not ok or served == "xgrammar"
            or float(int(t)) == int(t)}
    judge(compiled, tokenizer, vocab, schema, sure)
    for text in _walk_outputs(compiled, vocab, random.Random(json.dumps(schema))):
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text


def test_outlines_refuses_recursive_refs(compile_for, tokenizer, vocab):
    """A linked list (random schemas, 2026-12-07): at its recursion depth limit
    outlines-core wrote `{"v": 3,}` (the required `next` dropped, a trailing comma:
    not JSON). Refused naming `$ref`; auto serves it with llguidance. A `$ref` that
    does not come back to its target is still served."""
    schema = {"$ref": "#/$defs/node", "$defs": {"node": {
        "type": "object", "properties": {
            "v": {"const": 3}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        "required": ["v", "next"], "additionalProperties": False}}}
    with pytest.raises(UnsupportedSchemaError) as err:
        compile_for(P(json=schema, backend="outlines"))
    assert err.value.issues[0].keyword == "$ref"
    name, compiled = compile_for(P(json=schema, whitespace="compact"))
    assert name == "llguidance"
    judge(compiled, tokenizer, vocab, schema, {'{"v":3,"next":null}': True,
                                               '{"v":3,"next":{"v":3,"next":null}}': True,
                                               '{"v":3}': False})
    for text in _walk_outputs(compiled, vocab, random.Random("list")):
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text
    flat = {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {
        "b": {"$ref": "#/$defs/b"}}, "required": ["b"]}, "b": {"type": "integer"}}}
    assert compile_for(P(json=flat, backend="outlines"))[0] == "outlines"


def test_outlines_refuses_recursive_refs_in_draft_4():
    """In drafts 3-7 a node with `$ref` gets no per-node rules (the ref stands for its
    target): the recursion is found over the whole document (random schema 57)."""
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
              "properties": {"x": {"$ref": "#/definitions/node"}}, "required": ["x"],
              "definitions": {"node": {"type": "object", "properties": {
                  "v": {"type": "string"},
                  "next": {"anyOf": [{"$ref": "#/definitions/node"}, {"type": "null"}]}},
                  "required": ["v", "next"]}}}
    with pytest.raises(UnsupportedSchemaError) as err:
        choose_backend(P(json=schema, backend="outlines"))
    assert (err.value.issues[0].keyword, err.value.issues[0].path) == ("$ref", "$.definitions.node")
    assert choose_backend(P(json=schema)) == "llguidance"


@pytest.mark.parametrize("backend", ["auto", "xgrammar", "llguidance"])
def test_draft_4_const_does_not_prove_one_of_disjoint(backend):
    """Draft 4 has no `const`: jsonschema reads `{"const": false}` there as `{}`, so
    under `oneOf: [{const: false}, {type: null}]` null passes both branches and fails.
    xgrammar wrote `{"x": null}` (random schema 817): the disjointness proof now reads
    a branch as the declared draft does, and such a oneOf is refused."""
    one_of = {"oneOf": [{"const": False}, {"type": "null"}]}
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
              "properties": {"x": one_of}, "required": ["x"]}
    with pytest.raises(UnsupportedSchemaError) as err:
        choose_backend(P(json=draft4, backend=backend))
    assert err.value.issues[0].keyword == "oneOf"
    assert not jsonschema.Draft4Validator(draft4).is_valid({"x": None})
    later = {k: v for k, v in draft4.items() if k != "$schema"}     # 2020-12: const counts
    assert choose_backend(P(json=later, backend=backend))

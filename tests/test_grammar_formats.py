"""Formats and undeclared properties as generated, judged by jsonschema WITH its
format checker (the `jsonschema[format-nongpl]` checkers the test extras install):

- every `format` a backend serves generates only strings the checker accepts
  (llguidance's own date formats admitted 2021-02-29, year 0000 and leap seconds;
  xgrammar's also 2021-04-31, ipv4 leading zeros, 64-character host labels);
- the default "declared" mode closes objects without refusing what the schema's
  parts declare, and leaves `properties: {}` (nothing declared) open;
- drafts 3-7 ignore `$ref` siblings, as jsonschema does.
"""
from __future__ import annotations

import copy
import itertools
import json
import random
import re

import jsonschema
import pytest

from formwork.grammar.backend import allocate_bitmask, allowed_token_ids
from formwork.grammar.schema_check import UnsupportedSchemaError
from formwork.grammar.schema_closing import close_declared_objects, drop_legacy_ref_siblings
from formwork.grammar.schema_formats import DATE_PATTERNS
from formwork.grammar.selection import choose_backend
from formwork.schemas.structured import StructuredOutputsParams as P
from test_grammar_soundness import accepts, compile_for, vocab  # noqa: F401 (fixtures)

CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
LLGUIDANCE_FORMATS = ("date-time", "date", "time", "duration", "email", "hostname", "ipv4",
                      "ipv6", "uri", "uuid")


def format_valid(fmt: str, value: str) -> bool:
    return jsonschema.Draft202012Validator({"format": fmt}, format_checker=CHECKER).is_valid(value)


def test_the_format_checkers_are_installed():
    """Without them jsonschema passes every string and the checks below prove nothing."""
    assert {"date-time", "date", "time", "uri", "hostname", "ipv4"} <= set(CHECKER.checkers)
    assert not format_valid("date-time", "2021-02-29T00:00:00Z")
    assert not format_valid("uri", "not a uri")


def _date_grid():
    years = ["0000", "0001", "0004", "0100", "0400", "1900", "1996", "2000", "2021", "2024", "9999"]
    for y, m, d in itertools.product(years, range(0, 14), range(0, 33)):
        yield f"{y}-{m:02d}-{d:02d}"


def _time_grid():
    for h, mi, s in itertools.product((0, 9, 23, 24), (0, 59, 60), (0, 59, 60, 61)):
        for tail in ("Z", "z", ".5Z", "+05:30", "-23:59", "+24:00", "", ".Z", "+0530"):
            yield f"{h:02d}:{mi:02d}:{s:02d}{tail}"


def test_date_patterns_equal_the_format_checker():
    """DATE_PATTERNS say exactly what the checker accepts (it has no leap seconds
    either), over every month/day of leap, common and zero years and a time grid."""
    seen = {True: 0, False: 0}
    for date in _date_grid():
        got = re.fullmatch(DATE_PATTERNS["date"], date) is not None
        assert got == format_valid("date", date), date
        seen[got] += 1
        stamp = f"{date}T12:00:00Z"
        assert (re.fullmatch(DATE_PATTERNS["date-time"], stamp) is not None) \
            == format_valid("date-time", stamp), stamp
    for t in _time_grid():
        assert (re.fullmatch(DATE_PATTERNS["time"], t) is not None) == format_valid("time", t), t
        stamp = f"2024-02-29T{t}"
        assert (re.fullmatch(DATE_PATTERNS["date-time"], stamp) is not None) \
            == format_valid("date-time", stamp), stamp
    assert seen[True] > 3000 and seen[False] > 1000


DATE_CASES = {   # format -> {value: valid per the checker}
    "date-time": {"2000-02-29T00:00:00Z": True, "2021-02-29T00:00:00Z": False,
                  "1900-02-29T00:00:00Z": False, "0000-01-01T00:00:00Z": False,
                  "2021-04-31T00:00:00Z": False, "2021-01-01T10:00:60Z": False,
                  "2021-12-31t23:59:59.25+05:30": True},
    "date": {"2024-02-29": True, "2021-02-29": False, "0000-01-01": False, "2021-04-30": True},
    "time": {"10:00:59Z": True, "10:00:60Z": False, "23:59:59+23:59": True},
}


@pytest.mark.parametrize("backend", ["auto", "llguidance"])
@pytest.mark.parametrize("fmt", sorted(DATE_CASES))
def test_date_formats_admit_only_days_that_exist(compile_for, tokenizer, vocab, backend, fmt):
    schema = {"type": "string", "format": fmt}
    _, compiled = compile_for(P(json=schema, backend=backend))
    for value, valid in DATE_CASES[fmt].items():
        assert format_valid(fmt, value) == valid, value
        assert accepts(compiled, tokenizer, vocab, json.dumps(value)) == valid, value


def test_a_date_format_beside_a_pattern_keeps_both(compile_for, tokenizer, vocab):
    schema = {"type": "string", "format": "date", "pattern": "^20"}
    _, compiled = compile_for(P(json=schema))
    for value, ok in {"2024-02-29": True, "2021-02-29": False, "1996-02-29": False}.items():
        assert accepts(compiled, tokenizer, vocab, json.dumps(value)) == ok, value


@pytest.mark.parametrize("fmt,backend", [("date-time", "xgrammar"), ("date", "xgrammar"),
                                         ("time", "xgrammar"), ("ipv4", "xgrammar"),
                                         ("ipv6", "xgrammar"), ("hostname", "xgrammar"),
                                         ("date-time", "outlines")])
def test_loose_formats_are_refused_by_name(fmt, backend):
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}}
    with pytest.raises(UnsupportedSchemaError, match=r"'format' at \$\.properties\.v"):
        choose_backend(P(json=schema, backend=backend))
    assert choose_backend(P(json=schema)) == "llguidance"


def _walk(compiled, tokenizer, vocab, rng, max_tokens=60) -> str | None:
    """A random walk under the mask that favours one-character tokens (they reach
    the grammar's corners); the JSON text, or None if it did not finish."""
    matcher, bitmask, out = compiled.new_matcher(), allocate_bitmask(1, vocab.vocab_size), []
    for _ in range(max_tokens):
        matcher.fill_bitmask(bitmask, 0)
        allowed = allowed_token_ids(bitmask, 0, vocab.vocab_size)
        if vocab.eos_token_id in allowed and (len(allowed) == 1 or rng.random() < 0.25):
            return b"".join(vocab.token_bytes[i] for i in out).decode()
        ids = [i for i in allowed if i != vocab.eos_token_id]
        short = [i for i in ids if vocab.token_bytes[i] and len(vocab.token_bytes[i]) == 1]
        tid = rng.choice(short if short and rng.random() < 0.7 else ids)
        assert matcher.accept_tokens([tid])
        out.append(tid)
    return None


@pytest.mark.parametrize("fmt", LLGUIDANCE_FORMATS + ("uri-reference", "iri-reference"))
def test_walks_under_each_format_pass_the_checker(compile_for, tokenizer, vocab, fmt):
    """Before DATE_PATTERNS, 45 of 300 date-time walks here ended on a leap second."""
    _, compiled = compile_for(P(json={"type": "string", "format": fmt}, whitespace="compact"))
    rng, finished = random.Random(fmt), 0
    for _ in range(40):
        text = _walk(compiled, tokenizer, vocab, rng)
        if text is not None:
            finished += 1
            assert format_valid(fmt, json.loads(text)), text
    rarely = ("email", "uri", "uri-reference", "iri-reference")     # long walks: few close
    assert finished >= (2 if fmt in rarely else 20), finished


REFERENCES = {"../defs.json#/a": True, "/path/to?q=1&r=%41": True, "": True, "#frag": True,
              "https://example.com/a?b#c": True, "a b": False, "%zz": False, "/x\\y": False}


@pytest.mark.parametrize("fmt", ["uri-reference", "iri-reference"])
@pytest.mark.parametrize("backend", ["auto", "llguidance"])
def test_a_reference_format_admits_relative_references(compile_for, tokenizer, vocab, fmt,
                                                       backend):
    """llguidance has no `uri-reference`: it was narrowed to an absolute `uri`, which
    refused "../defs.json#/a". Now a `uri` or an RFC 3986 relative reference (without
    an authority); beside a maxLength both hold."""
    _, compiled = compile_for(P(json={"type": "string", "format": fmt}, backend=backend))
    for value, ok in REFERENCES.items():
        assert format_valid(fmt, value) == ok, value
        assert accepts(compiled, tokenizer, vocab, json.dumps(value)) == ok, value
    _, short = compile_for(P(json={"type": "string", "format": fmt, "maxLength": 8},
                             backend=backend))
    assert accepts(short, tokenizer, vocab, '"#frag"')
    assert not accepts(short, tokenizer, vocab, '"../defs.json#/a"')


# --- undeclared properties ("declared", the default) -------------------------------------

def test_empty_properties_declare_nothing_and_stay_open(compile_for, tokenizer, vocab):
    schema = {"type": "object", "properties": {"vars": {"type": ["object", "null"], "properties": {}}}}
    _, compiled = compile_for(P(json=schema, whitespace="compact"))
    for text in ('{"vars":{"x":5,"y":"z"}}', '{"vars":null}', '{"vars":{}}'):
        assert accepts(compiled, tokenizer, vocab, text), text
    assert not accepts(compiled, tokenizer, vocab, '{"other":1}')       # the root is closed


INTERSECTED = {"type": "object", "properties": {"p": {"type": "string"}},
               "anyOf": [{"$ref": "#/$defs/b"}],
               "$defs": {"b": {"type": "object", "properties": {"q": {"type": "integer"}}}}}


def test_an_intersected_object_is_closed_to_the_names_its_parts_declare(compile_for, tokenizer, vocab):
    """Each part closed to its own names admitted only {} here (p refused by b, q by the node)."""
    _, compiled = compile_for(P(json=INTERSECTED, whitespace="compact"))
    validator = jsonschema.Draft202012Validator(INTERSECTED)
    for text, ok in {'{"p":"s"}': True, '{"q":1}': True, '{"p":"s","q":1}': True,
                     '{"p":"s","q":"x"}': False, '{"p":"s","r":1}': False}.items():
        assert not ok or validator.is_valid(json.loads(text)), text
        assert accepts(compiled, tokenizer, vocab, text) == ok, text


def test_close_declared_objects_unions_parts_and_leaves_them_open():
    closed = close_declared_objects(INTERSECTED)
    assert closed["additionalProperties"] is False
    assert set(closed["properties"]) == {"p", "q"} and closed["properties"]["q"] == {}
    assert "additionalProperties" not in closed["$defs"]["b"]         # a part: left open
    alone = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}},
             "$defs": {"x": {"type": "object", "properties": {"k": {}}}}}
    out = close_declared_objects(alone)                               # a plain $ref: no intersection
    assert out["additionalProperties"] is False and out["$defs"]["x"]["additionalProperties"] is False
    opened = INTERSECTED | {"$defs": {"b": {"type": "object", "patternProperties": {"^x": {}}}}}
    assert "additionalProperties" not in close_declared_objects(opened)   # a part admits more
    required_only = {"required": ["a", "b"], "anyOf": [{"properties": {"a": {}}},
                                                        {"properties": {"b": {}}}]}
    out = close_declared_objects(required_only)
    assert out["additionalProperties"] is False and set(out["properties"]) == {"a", "b"}
    before = copy.deepcopy(INTERSECTED)
    close_declared_objects(INTERSECTED)
    assert INTERSECTED == before                                      # input not mutated


def test_forbidden_names_declare_nothing_and_required_names_of_parts_count():
    """`properties: {b: false}` (how "b is absent" reaches llguidance) declared only a
    forbidden name, and closing admitted only {}; a part that requires a name it never
    declares (a schema's typo) made the intersected node unsatisfiable once closed."""
    forbidden = {"type": "object", "properties": {"b": False}}
    assert close_declared_objects(forbidden) == forbidden
    mixed = {"type": "object", "properties": {"a": {}, "b": False}}
    assert close_declared_objects(mixed)["additionalProperties"] is False
    typo = {"type": "object", "properties": {"g": {"type": "string"}},
            "oneOf": [{"symbol": {"type": "string"}, "required": ["symbol"]},
                      {"required": ["symbols"]}]}
    out = close_declared_objects(typo)
    assert out["additionalProperties"] is False
    assert set(out["properties"]) == {"g", "symbol", "symbols"}


def test_not_both_keeps_other_properties(compile_for, tokenizer, vocab):
    """A held-out schema: `{type: object, not: {required: [body, bodyValue]}}` declares
    nothing, so it is open; its "not both" became two branches each forbidding one
    name, which closing turned into {} only (every valid instance refused)."""
    schema = {"type": "object", "not": {"required": ["body", "bodyValue"]}}
    _, compiled = compile_for(P(json=schema, whitespace="compact"))
    validator = jsonschema.Draft202012Validator(schema)
    for text, ok in {'{}': True, '{"id":"x"}': True, '{"body":1,"id":"x"}': True,
                     '{"bodyValue":"v"}': True, '{"body":1,"bodyValue":2}': False}.items():
        assert validator.is_valid(json.loads(text)) == ok, text
        assert accepts(compiled, tokenizer, vocab, text) == ok, text


LEGACY = {"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/a",
          "properties": {"x": {"type": "integer"}},
          "definitions": {"a": {"type": "object", "properties": {"y": {"type": "string"}}}}}


def test_legacy_ref_siblings_are_ignored_as_jsonschema_does(compile_for, tokenizer, vocab):
    assert drop_legacy_ref_siblings(LEGACY) == {k: v for k, v in LEGACY.items() if k != "properties"}
    later = LEGACY | {"$schema": "https://json-schema.org/draft/2020-12/schema"}
    assert drop_legacy_ref_siblings(later) is later
    _, compiled = compile_for(P(json=LEGACY, whitespace="compact", additional_properties="schema"))
    validator = jsonschema.validators.validator_for(LEGACY)(LEGACY)
    for text in ('{"y":"s","x":"not an integer"}', '{"y":"s"}'):
        assert validator.is_valid(json.loads(text))
        assert accepts(compiled, tokenizer, vocab, text), text
    assert not accepts(compiled, tokenizer, vocab, '{"y":1}')

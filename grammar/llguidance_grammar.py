"""What llguidance enforces for a request: `to_llguidance(params)` checks a
constraint (JSON Schema, regex, choice, Lark/GBNF grammar, structural tag) and
returns the llguidance grammar string for it, or refuses it with the keyword and
JSON path named. Needs no tokenizer and no torch: the gateway's admission check and
the compile pool both call it (grammar/llguidance_backend.py builds matchers).

llguidance's JSON-Schema compiler enforces what it accepts and refuses the rest
("Unimplemented keys: [...]"); formwork never lets a schema switch it to its
`lenient` mode. Its strings follow RFC 8259 (no raw control characters) and its
`pattern`s are exact. Where a schema allows properties it does not declare,
llguidance generates them too (the output language is the schema's).
"""
from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from fractions import Fraction
from typing import Any

import jsonschema
import llguidance as llg

from formwork.grammar.gbnf_lark import gbnf_to_lark, is_gbnf
from formwork.grammar.regex_classes import portable_classes
from formwork.grammar.regex_safety import escape_literal
from formwork.grammar.schema_check import (
    SchemaIssue,
    UnsupportedSchemaError,
    check_metaschema,
    locate_keyword,
    native_schema_error,
    portable_pattern,
)
from formwork.grammar.schema_formats import (
    backend_format,
    exact_dates,
    float_multiple_of,
    float_safe_bounds,
    is_number,
    number_forms,
    raise_lowest_bound,
)
from formwork.grammar.schema_normalize import map_subschemas, normalize
from formwork.grammar.schema_oneof import inferred_types, pairwise_disjoint
from formwork.grammar.schema_pattern_names import pattern_name_issues, portable_pattern_names
from formwork.grammar import unique_items
from formwork.grammar.schema_rules import duplicate_name_issues
from formwork.grammar.schema_values import inexact_values
from formwork.grammar.schema_closing import close_declared_objects, drop_legacy_ref_siblings
from formwork.grammar.schema_walk import child_path, iter_nodes, map_ref_targets, validator_class
from formwork.grammar.structural_tag import (AnswerOrCalls, LarkContent, answer_or_calls,
                                             triggered_tags)
from formwork.schemas.structured import StructuredOutputsParams

# A schema's own "x-guidance" options are applied before these, so it can never
# turn on `lenient` (ignore unimplemented keywords) or `coerce_one_of` (oneOf as anyOf).
_SOUND = {"lenient": False, "coerce_one_of": False}
# The formats llguidance 1.9.1 implements (measured: the others are "Unknown format").
FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4",
                     "ipv6", "uri", "uuid"})
# Measured: a lower bound at or below -2**63 + 512 fails to build ("Failed to generate
# regex for integer range"), e.g. int64's minimum; it is raised to this instead.
LOWEST_BOUND = -(2**63) + 1024
_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \[([^\]]*)\]')
_FORMAT = re.compile(r"Unknown format: (\S+)")
_MISSING_REF = re.compile(r"Pointer '([^']*)' does not exist")
# serde_json's recursion limit (128) as it meets a schema inside llguidance's grammar
# wrapper: measured, a schema 124 objects deep is read and one 125 deep is not
_READER_DEPTH = 125
_REMOTE_REF = re.compile(r"Resource '([^']*)' is not present in a registry")
_UNSERIALIZABLE = re.compile(r"not JSON serializable: (-?\d+)$")


# llguidance bounds the lexer work per token ("fuel"); past it the matcher enters a
# permanent error state mid-generation ("too many expressions constructed").
# Patterned strings under a length bound (`^(?:\\S+\\s+){0,49}\\S+$` with
# maxLength 500, JSONSchemaBench Github_medium/o21142) ran out at the defaults
# (step 200k, initial 1M) within ~100 tokens; 10x keeps those alive and still
# bounds one mask step. A matcher that errors anyway ends its request with the
# error (never an unconstrained or truncated output). (Here, not in the backend
# module, so that the gateway's output check reads it without importing torch.)
LIMITS = dict(step_lexer_fuel=2_000_000, initial_lexer_fuel=10_000_000)


def json_options(params: StructuredOutputsParams) -> dict[str, Any]:
    """Whitespace: the request's pattern (checked: JSON whitespace only), none at all,
    or at most `max_whitespace` characters per run."""
    if params.whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": f"(?:{params.whitespace_pattern})"}
    if params.whitespace == "compact" or params.max_whitespace == 0:
        return {"whitespace_flexible": False}
    return {"whitespace_flexible": True,
            "whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{params.max_whitespace}}}"}


def _grammar_error(grammar: str) -> str:
    """'' if llguidance builds `grammar` (no tokenizer needed), else its error."""
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0].strip() if is_error else ""


def _schema_error(schema: Any, message: str) -> UnsupportedSchemaError:
    """llguidance's refusal as keyword + JSON path (the first node holding it)."""
    if m := _MISSING_REF.search(message):
        ref = "#" + m.group(1)
        path = next((n.path for n in iter_nodes(schema) if n.schema.get("$ref") == ref), "$")
        return UnsupportedSchemaError([SchemaIssue(
            "$ref", path, f"cannot resolve {ref!r}: nothing at that JSON pointer from the "
                          "schema's root")], "llguidance")
    if m := _REMOTE_REF.search(message):
        return UnsupportedSchemaError([_remote_ref_issue(schema, m.group(1))], "llguidance")
    if message.strip().startswith("schema too large"):
        return UnsupportedSchemaError([SchemaIssue(
            "", "$", "too large for llguidance's JSON compiler: over its budget of schema "
                     "nodes, ~16,700 properties of one object")], "llguidance")
    if "recursion limit exceeded" in message:          # serde_json's, reading the schema
        return UnsupportedSchemaError([SchemaIssue(
            "", _path_at_depth(schema, _READER_DEPTH),
            f"nested deeper than llguidance's JSON reader takes ({_READER_DEPTH - 1} levels "
            "of objects and arrays)")], "llguidance")
    if m := _UNIMPLEMENTED.search(message):
        keywords = json.loads(f"[{m.group(1)}]") or ["?"]
    elif "patternProperty regexes" in message:           # "... /a/ and /b/ are not disjoint"
        keywords = ["patternProperties"]
    elif "incompatible types" in message and any("allOf" in sn.schema for sn in iter_nodes(schema)):
        keywords = ["allOf"]
    elif m := _FORMAT.search(message):
        keywords = ["format"]
    elif "regex parse error" in message and (culprit := _regex_culprit(schema)):
        return UnsupportedSchemaError([SchemaIssue(
            culprit[0], culprit[1], f"llguidance: {message.strip().splitlines()[-1]} in "
                                    f"{culprit[2]!r}")], "llguidance")
    elif "Unsatisfiable" in message and (culprit := _unsatisfiable_values(schema)):
        return UnsupportedSchemaError([SchemaIssue(
            culprit[0], culprit[1], f"{culprit[2]} (llguidance: {message.splitlines()[0]})")],
            "llguidance")
    elif "oneOf" in message:
        keywords = ["oneOf"]
        message = "oneOf branches are not provably disjoint"
    elif "required item is unsatisfiable" in message:      # minItems past what items allow
        keywords = ["minItems"]
    elif "required property" in message:
        keywords = ["required"]
    else:
        return native_schema_error(schema, message, "llguidance")
    issues = [SchemaIssue(kw, locate_keyword(schema, kw), f"llguidance: {message.splitlines()[0]}")
              for kw in keywords]
    return UnsupportedSchemaError(issues, "llguidance")


def _path_at_depth(document: Any, depth: int) -> str:
    """JSON path of the first object or array nested `depth` deep (the root is 1)."""
    stack = [(document, "$", 1)]
    while stack:
        node, path, level = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        if level >= depth:
            return path
        items = node.items() if isinstance(node, dict) else enumerate(node)
        stack += reversed([(v, child_path(path, k), level + 1) for k, v in items])
    return "$"


def _remote_ref_issue(schema: Any, resource: str) -> SchemaIssue:
    """The `$ref` naming a document outside the schema (llguidance's message gives
    the resolved address, e.g. json-schema:///other.json for `other.json#/x`)."""
    remote = [sn for sn in iter_nodes(schema)
              if isinstance(sn.schema.get("$ref"), str) and not sn.schema["$ref"].startswith("#")]
    named = [sn for sn in remote if (doc := sn.schema["$ref"].split("#")[0]) and resource.endswith(doc)]
    sn = (named or remote or [None])[0]
    ref = sn.schema["$ref"] if sn else resource
    return SchemaIssue("$ref", sn.path if sn else "$",
                       f"cannot resolve {ref!r}: remote references are not fetched; only refs "
                       "within the schema are supported ('#', a JSON pointer such as "
                       "'#/$defs/Name', or an $id the schema itself declares)")


def _unsatisfiable_values(schema: Any) -> tuple[str, str, str] | None:
    """(keyword, path, why) of the first node whose `enum`/`const` no value passes
    (an empty enum, a const outside the enum beside it): where llguidance calls the
    schema unsatisfiable it names what that made unmeetable (`required` at $), not
    the node."""
    if not isinstance(schema, dict):
        return None
    validator = validator_class(schema)(schema)
    for sn in iter_nodes(schema):
        node = sn.schema
        if node.get("enum") == []:
            return "enum", sn.path, "an empty enum admits no value"
        if "const" not in node and "enum" not in node:
            continue
        values = ([node["const"]] if "const" in node else []) + list(node.get("enum") or [])
        sub = validator.evolve(schema=node)
        if not any(sub.is_valid(v) for v in values):
            keyword = "const" if "const" in node else "enum"
            return keyword, sn.path, f"no value of '{keyword}' passes the keywords beside it"
    return None


def _regex_culprit(schema: Any) -> tuple[str, str, str] | None:
    """(keyword, path, regex) of the first `pattern` or `patternProperties` name that
    llguidance cannot parse on its own (its message quotes the regex as rewritten)."""
    for sn in iter_nodes(schema):
        found = [("pattern", sn.path, sn.schema["pattern"])] \
            if isinstance(sn.schema.get("pattern"), str) else []
        if isinstance(sn.schema.get("patternProperties"), dict):
            found += [("patternProperties", f"{sn.path}.patternProperties", name)
                      for name in sn.schema["patternProperties"]]
        for keyword, path, regex in found:
            probe = {"type": "string", "pattern": portable_classes(regex)}
            if _grammar_error(llg.LLMatcher.grammar_from_json_schema(probe)):
                return keyword, path, regex
    return None


def _closed(schema: Any, params: StructuredOutputsParams) -> Any:
    """`schema` as generated: objects closed to their declared properties by default,
    formats as llguidance serves them (`backend_format`), pattern classes as both
    ECMA-262 and Python's `re` read them (regex_classes.py), in `patternProperties`
    names too (schema_pattern_names.py), numeric bounds as 15-digit inclusive ones
    just inside them (`float_safe_bounds`), and the numbers llguidance's range regex
    refuses under a bound, or writes only with more fraction digits, added back
    (`number_forms`)."""
    if isinstance(schema, dict):
        draft3 = validator_class(schema) is jsonschema.Draft3Validator
        schema = map_subschemas(schema, lambda n: number_forms(_float_multiple(
            portable_pattern_names(portable_pattern(raise_lowest_bound(float_safe_bounds(
                exact_dates(backend_format(n, FORMATS, draft3), draft3)), LOWEST_BOUND),
                json_string=True, rust_sets=True)))))
    schema = drop_legacy_ref_siblings(schema)
    if params.additional_properties == "declared":
        schema = close_declared_objects(schema)
    return {} if schema is True else schema


def _json_grammar(schema: Any, params: StructuredOutputsParams) -> str:
    generated = _closed(schema, params)
    _refuse_duplicate_name_counts(generated)
    try:
        return llg.LLMatcher.grammar_from_json_schema(
            generated, defaults=json_options(params), overrides=_SOUND)
    except UnsupportedSchemaError:
        raise
    except ValueError as e:        # its JSON reader: "Value is not JSON serializable: 2**64"
        raise _unreadable_value(schema, str(e)) from None


def _unreadable_value(schema: Any, message: str) -> UnsupportedSchemaError:
    """llguidance's refusal of a value it cannot read (an integer past 64 bits), naming
    the keyword that holds it."""
    if m := _UNSERIALIZABLE.search(message):
        value = int(m.group(1))
        for sn in iter_nodes(schema):
            for kw, v in sn.schema.items():
                if is_number(v) and v == value:
                    return UnsupportedSchemaError([SchemaIssue(
                        kw, sn.path, f"{kw} {value}: llguidance reads integers of at most "
                                     "64 bits")], "llguidance")
    return native_schema_error(schema, message, "llguidance")


def _float_multiple(node: dict) -> dict:
    """`float_multiple_of`; a node it cannot serve was refused by `_checked_schema`
    (one that only a rewrite produced keeps its multipleOf)."""
    narrowed = float_multiple_of(node)
    return node if narrowed is None else narrowed


def _refuse_float_multiples(schema: Any) -> None:
    """A decimal multipleOf `float_multiple_of` cannot serve, or narrows to a step
    of which the node's bounds hold no multiple, is refused naming it."""
    for sn in iter_nodes(schema):
        narrowed = float_multiple_of(sn.schema)
        m = sn.schema.get("multipleOf")
        if narrowed is None:
            why = "no decimal multiple of it can be relied on to divide exactly (not even " \
                  "integers); use a power-of-two fraction (0.5, 0.25), one within 2^-54 of " \
                  "its float (0.01, 0.1), or an integer"
        elif narrowed is not sn.schema and not _multiple_within(sn.schema, narrowed):
            why = f"only the multiples of {narrowed['multipleOf']} can be relied on to " \
                  "divide exactly, and the bounds here hold none"
        else:
            continue
        raise UnsupportedSchemaError([SchemaIssue(
            "multipleOf", sn.path, f"multipleOf {m!r}: jsonschema checks it in binary "
                                   f"floating point, where {why}")], "llguidance")


def _refuse_int64_ranges(schema: Any) -> None:
    """Number ranges llguidance 1.9 reads wrongly, refused naming the bound: it reads
    integer bounds as int64, so a lower bound past 2^63 - 1 became 2^63 - 1 (under
    `minimum: 2^63, maximum: 2^63 + 5` every output was 9223372036854775807, below
    the minimum); and a range wholly at or below LOWEST_BOUND, whose minimum
    `raise_lowest_bound` cannot raise without emptying it, it cannot build -- with a
    minimum there too (an int64 range of the lowest few hundred values) building it
    crashed the process (SIGSEGV in `validate_grammar`), in the gateway's synchronous
    check and again in the engine."""
    for sn in iter_nodes(schema):
        for kw in ("maximum", "exclusiveMaximum"):
            v = sn.schema.get(kw)
            if is_number(v) and v <= LOWEST_BOUND:
                raise UnsupportedSchemaError([SchemaIssue(
                    kw, sn.path, f"{kw} {v}: llguidance builds no number range that lies "
                                 f"wholly at or below {LOWEST_BOUND} (-2^63 + 1024)")],
                    "llguidance")
        for kw in ("minimum", "exclusiveMinimum"):
            v = sn.schema.get(kw)
            if is_number(v) and v >= 2**63 - (kw == "exclusiveMinimum"):
                raise UnsupportedSchemaError([SchemaIssue(
                    kw, sn.path, f"{kw} {v}: llguidance reads number bounds as 64-bit "
                                 "integers, where this one would be 2^63 - 1")], "llguidance")


def _refuse_inexact_values(schema: Any) -> None:
    """An enum/const number llguidance would write as another number
    (grammar/schema_values.py: 0.9619009378982257 written ...256), refused naming it."""
    for sn in iter_nodes(schema):
        if issues := inexact_values(sn, "llguidance"):
            kw, detail = issues[0]
            raise UnsupportedSchemaError([SchemaIssue(kw, sn.path, detail)], "llguidance")


# Subschemas an instance is tested against, never generated from.
_TESTED_ONLY = ("if", "not", "propertyNames")


def _refuse_duplicate_name_counts(generated: Any) -> None:
    """`duplicate_name_issues` on the objects as generated (closed by default);
    conditions (`if`, `not`, `propertyNames`) generate nothing and are skipped."""
    tested = {id(sub.schema) for sn in iter_nodes(generated)
              for key in _TESTED_ONLY if isinstance(sn.schema.get(key), dict)
              for sub in iter_nodes(sn.schema[key])}
    issues = [SchemaIssue(kw, sn.path, detail) for sn in iter_nodes(generated)
              if id(sn.schema) not in tested
              for kw, detail in duplicate_name_issues(sn.schema, open_by_default=True)]
    if issues:
        raise UnsupportedSchemaError(issues, "llguidance")


def _disputed_pattern_names(schema: Any) -> list[SchemaIssue]:
    """What `portable_pattern_names` cannot serve exactly (schema_pattern_names.py)."""
    return [SchemaIssue(kw, sn.path, detail) for sn in iter_nodes(schema)
            for kw, detail in pattern_name_issues(sn.schema)]


def _multiple_within(node: dict, narrowed: dict) -> bool:
    """Whether the node's bounds hold a multiple of the narrowed step (exact)."""
    step = Fraction(narrowed["multipleOf"])
    lo = hi = None
    for kw, exclusive in (("minimum", False), ("exclusiveMinimum", True)):
        v = node.get(kw)
        if is_number(v) and math.isfinite(v):
            q = Fraction(v) / step
            first = (math.floor(q) + 1 if exclusive else math.ceil(q)) * step
            lo = first if lo is None else max(lo, first)
    for kw, exclusive in (("maximum", False), ("exclusiveMaximum", True)):
        v = node.get(kw)
        if is_number(v) and math.isfinite(v):
            q = Fraction(v) / step
            last = (math.ceil(q) - 1 if exclusive else math.floor(q)) * step
            hi = last if hi is None else min(hi, last)
    return lo is None or hi is None or lo <= hi


def _widened(node: dict) -> dict:
    """`node` without what `_closed` narrows (its `format`; a lower bound under
    LOWEST_BOUND, which `_closed` raises) and its `pattern`'s classes read as widely
    as either ECMA-262 or Python does: every instance `node` admits passes."""
    drop = {"format"} | {kw for kw in ("minimum", "exclusiveMinimum")
                         if is_number(node.get(kw)) and node[kw] < LOWEST_BOUND}
    node = {k: v for k, v in node.items() if k not in drop} if drop & node.keys() else node
    return portable_pattern(node, either=True)


def _one_of_error(schema: Any, params: StructuredOutputsParams) -> str:
    """'' if every oneOf of `schema` keeps its meaning once objects are closed.

    llguidance serves a oneOf whose branches it proves disjoint, and it proves that
    on the schema it is given: with `additional_properties="declared"` objects are
    closed first, and two branches closed to different names look disjoint where
    the schema's own branches overlap (`oneOf: [{required: [a]}, {properties:
    {b: ...}}]`: `{"a": "x"}` passes both, so it is invalid, yet the first branch,
    closed, generates it). So the proof is asked of the schema as written (objects
    open; formats and the int64 floor dropped, which widens it), and its verdict
    holds for the closed one, which generates a subset of each branch."""
    if params.additional_properties != "declared" or not isinstance(schema, dict) \
            or '"oneOf"' not in json.dumps(schema):
        return ""
    widened = drop_legacy_ref_siblings(map_subschemas(schema, _widened))
    return _grammar_error(llg.LLMatcher.grammar_from_json_schema(
        widened, defaults=json_options(params), overrides=_SOUND))


def _checked_schema(schema: Any, params: StructuredOutputsParams) -> tuple[Any, str]:
    """(schema, grammar): `schema` or formwork's equivalent rewrite of it (allOf
    merged, provably disjoint oneOf as anyOf, ...) when llguidance refuses the
    original, with the grammar that enforces it."""
    check_metaschema(schema)
    if schema is False:
        raise UnsupportedSchemaError([SchemaIssue("false", "$", "the schema admits no value")],
                                     "llguidance")
    _refuse_float_multiples(schema)
    _refuse_int64_ranges(schema)
    _refuse_inexact_values(schema)
    disputed = _disputed_pattern_names(schema)
    if disputed:                             # `allOf` beside it, say: merged, it may pass
        merged = normalize(schema, exact_false=True)
        if _disputed_pattern_names(merged):
            raise UnsupportedSchemaError(disputed, "llguidance")
        schema = merged
    refusal: UnsupportedSchemaError | None = None
    try:
        grammar = _json_grammar(schema, params)
        error = _grammar_error(grammar) or _one_of_error(schema, params)
    except UnsupportedSchemaError as e:   # formwork's own refusal; a rewrite may avoid it
        refusal, error = e, str(e)
    if not error:
        return schema, grammar
    normalized = normalize(schema, exact_false=True)
    for rewritten in (normalized, _disjoint_one_of_as_any_of(_state_types(normalized), params)):
        if rewritten is not schema and isinstance(rewritten, dict):
            try:
                grammar = _json_grammar(rewritten, params)
            except UnsupportedSchemaError:
                continue
            if not _grammar_error(grammar) and not _one_of_error(rewritten, params):
                return rewritten, grammar
    raise refusal or _schema_error(schema, error)


def _checked_json(schema: Any, params: StructuredOutputsParams) -> str:
    # `uniqueItems` at the sites grammar/unique_items.py serves is kept while decoding
    # (its matcher wrapper): the grammar is built without it there.
    return _checked_schema(unique_items.plan(schema).schema, params)[1]


def _lark_text(text: str) -> str:
    return json.dumps(text) if text else ""


def _embedded(schema: Any, params: StructuredOutputsParams) -> str:
    """A checked schema as the argument of Lark's `%json`, with the request's JSON
    options and formwork's soundness options."""
    embedded = _closed(schema, params)
    embedded = (embedded if isinstance(embedded, dict) else {}) | {"x-guidance": {
        **json_options(params), **(embedded.get("x-guidance") or {}), **_SOUND}}
    return json.dumps(embedded)


def _content(schema: Any, params: StructuredOutputsParams) -> str:
    """A tag's content in Lark: its schema's JSON, or a Lark grammar's language (a
    nested grammar: its own `start`, rule names and `%ignore` kept to itself)."""
    if isinstance(schema, LarkContent):
        return "%lark {\n" + schema.grammar + "\n}"
    return f"%json {_embedded(schema, params)}"


def _answer_or_calls_lark(aoc: AnswerOrCalls, params: StructuredOutputsParams) -> str:
    """The answer's JSON, or the calls (each begin, its content, end; `separator`
    between them, one only with stop_after_first) and nothing else."""
    lines = ["%llguidance {}"]
    if aoc.answer is not None:
        lines.append(f"answer: %json {_embedded(aoc.answer, params)}")
    for i, (begin, schema, end) in enumerate(aoc.tags):
        lines.append(f"tag_{i}: {_lark_text(begin)} {_content(schema, params)} "
                     f"{_lark_text(end)}")
    lines.append("call: " + " | ".join(f"tag_{i}" for i in range(len(aoc.tags))))
    calls = "call" if aoc.stop_after_first else f"call ({_lark_text(aoc.separator)} call)*"
    lines.append(f"start: answer | {calls}" if aoc.answer is not None else f"start: {calls}")
    return "\n".join(lines)


def _structural_tag_lark(spec: Any, params: StructuredOutputsParams) -> str:
    """Free text in which each trigger starts a tag: the trigger is a lazy lexeme
    (it ends the text as soon as it appears), then the rest of `begin`, the JSON
    its schema allows, and `end` (llguidance's documented tool-calling shape).
    Or the answer-or-calls shape of a response_format beside tool_choice auto."""
    aoc = answer_or_calls(spec, params, check=lambda s: _checked_schema(s, params)[0])
    if aoc is not None:     # (its `uniqueItems` stay refused: the wrapper follows tags only)
        return _answer_or_calls_lark(aoc, params)
    # a tag schema's served `uniqueItems` are kept while decoding (the wrapper follows
    # each tag's value: grammar/unique_items.py TagScan); its grammar is built without
    tt = triggered_tags(spec, params,
                        check=lambda s: _checked_schema(unique_items.plan(s).schema, params)[0])
    lines, rules = ["%llguidance {}"], []
    for i, (begin, schema, end) in enumerate(tt.tags):
        trigger = max((t for t in tt.triggers if begin.startswith(t)), key=len)
        lines.append(f"tag_{i}_trig[lazy]: TEXT {_lark_text(trigger)}")
        lines.append(f"tag_{i}: tag_{i}_trig {_lark_text(begin[len(trigger):])} "
                     f"{_content(schema, params)} {_lark_text(end)}")
        rules.append(f"tag_{i}")
    any_tag = "(" + " | ".join(rules) + ")"
    if tt.stop_after_first:
        start = any_tag if tt.at_least_one else f"TEXT | {any_tag}"
    else:
        start = f"{any_tag}{'+' if tt.at_least_one else '*'} TEXT"
    lines += [f"start: {start}", "TEXT: /(.|\\n)*/"]
    return "\n".join(lines)


_VALUES = frozenset({"enum", "const", "default", "examples"})   # data, never schemas


def _state_types(root: Any) -> Any:
    """`state_inferred_type` on every subschema, `$ref` targets anywhere included."""
    if not isinstance(root, dict):
        return root
    root = map_subschemas(root, state_inferred_type)
    return map_ref_targets(root, lambda n: map_subschemas(n, state_inferred_type),
                           skip=lambda parts: False)


def state_inferred_type(node: dict) -> dict:
    """`node` with the type formwork's oneOf proofs assume it generates (`object`
    for `properties`, `array` for `items`, as xgrammar infers) stated: llguidance
    generates every type for a node without `type`, and `"x"` passes two untyped
    object branches, so it is no member of their oneOf. Stricter only on values
    of other types."""
    types = inferred_types(node)
    return node | {"type": next(iter(types))} if "type" not in node and types is not None \
        and len(types) == 1 else node


def _disjoint_one_of_as_any_of(root: Any, params: StructuredOutputsParams) -> Any:
    """`root` with each oneOf whose branches formwork proves pairwise disjoint
    spelled anyOf (the same language); llguidance proves fewer of them itself.
    What each branch generates (objects closed, by default) is judged against the
    other branches as written."""
    if not isinstance(root, dict):
        return root
    root = drop_legacy_ref_siblings(root)      # exact; `_closed` drops them too
    gen_root = close_declared_objects(root) if params.additional_properties == "declared" \
        else root
    validator = validator_class(root)(root)

    def rewrite(node: Any, gen: Any) -> Any:
        """Every object of the document, not only the subschemas map_subschemas
        knows: a `$ref` may point anywhere (`#/onvif/ptz/SpaceSelector`). `gen`:
        the same place in `gen_root` (None where the two differ)."""
        if isinstance(node, list):
            gens = gen if isinstance(gen, list) and len(gen) == len(node) else [None] * len(node)
            return [rewrite(v, g) for v, g in zip(node, gens)]
        if not isinstance(node, dict):
            return node
        gen = gen if isinstance(gen, dict) else {}
        one_of = node.get("oneOf")
        node = {k: v if k in _VALUES else rewrite(v, gen.get(k)) for k, v in node.items()}
        if isinstance(one_of, list) and "anyOf" not in node and \
                pairwise_disjoint(one_of, root, validator, gen.get("oneOf"), gen_root):
            node = {("anyOf" if k == "oneOf" else k): v for k, v in node.items()}
        return node
    return rewrite(root, gen_root)


# Grammars already checked: `auto` checks a constraint, then the compile pool
# compiles it; without this the grammar would be built and validated twice.
_CHECKED: OrderedDict[str, str] = OrderedDict()
_CHECKED_LOCK = threading.Lock()
_CHECKED_SIZE = 512


def to_llguidance(params: StructuredOutputsParams) -> str:
    """Check `params` and return the llguidance grammar (a string) that enforces it."""
    key = params.cache_key()
    with _CHECKED_LOCK:
        if key in _CHECKED:
            _CHECKED.move_to_end(key)
            return _CHECKED[key]
    grammar = _checked_grammar(params)
    with _CHECKED_LOCK:
        _CHECKED[key] = grammar
        while len(_CHECKED) > _CHECKED_SIZE:
            _CHECKED.popitem(last=False)
    return grammar


def _checked_grammar(params: StructuredOutputsParams) -> str:
    kind, spec = params.kind(), params.spec()
    if kind == "json":
        return _checked_json(spec, params)
    if kind == "json_object":
        return _json_grammar({"type": "object"}, params)
    if kind == "regex":
        # \d \s \W ... and `.` as both ECMA-262 and Python's `re` read them (Rust's
        # are Unicode-aware: '１２' for \d+): regex_classes.py
        grammar = llg.LLMatcher.grammar_from_regex(portable_classes(spec))
    elif kind == "choice":
        grammar = llg.LLMatcher.grammar_from_regex("|".join(f"({escape_literal(c)})" for c in spec))
    elif kind == "structural_tag":
        grammar = llg.LLMatcher.grammar_from_lark(_structural_tag_lark(spec, params))
    elif kind == "grammar":
        # xgrammar's EBNF is GBNF; anything without `::=` is taken as Lark.
        try:
            lark = gbnf_to_lark(spec) if is_gbnf(spec) else spec
        except Exception as err:   # the converter raises bare Exceptions/AssertionErrors
            raise ValueError(f"llguidance cannot convert this grammar to Lark: {err}") from None
        grammar = llg.LLMatcher.grammar_from_lark(lark)
    else:
        raise ValueError(f"llguidance: {kind} constraints are served by backend 'xgrammar'")
    error = _grammar_error(grammar)
    if error:
        raise ValueError(f"llguidance cannot compile this {kind}: {error.splitlines()[0]}")
    return grammar

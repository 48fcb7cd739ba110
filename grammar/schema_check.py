"""Which JSON Schema keywords a backend cannot enforce, and where.

`check_metaschema` rejects schemas that are not valid JSON Schema (for the
draft they declare, 2020-12 by default). `find_issues(schema, backend)` lists
`(keyword, json_path)` for every reachable keyword the backend would drop or
weaken. The rules were measured against xgrammar 0.2.9 and outlines-core
0.2.14 (tests/test_grammar_schema_check.py keeps them honest): a keyword not
listed here either annotates only (title, description, default, format, ...)
or is enforced exactly, or only made stricter (e.g. fixed property order).
"""
from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import jsonschema
import jsonschema_rs
import referencing.exceptions

from formwork.grammar.regex_classes import portable_classes
from formwork.grammar.schema_rewrites import (
    drop_implied_lengths,
    drop_inapplicable,
    lengths_as_plain_pattern,
)
from formwork.grammar.schema_rules import (
    ASSERTIONS as ASSERTION_KEYWORDS,
    XGRAMMAR_FORMAT_LENGTHS,
    XGRAMMAR_NARROWER_FORMAT,
    common_issues,
    ref_issues,
    outlines_only_issues,
    recursive_ref_issues,
    xgrammar_only_issues,
)
from formwork.grammar.schema_normalize import map_subschemas, normalize
from formwork.grammar.schema_walk import (
    SchemaNode,
    child_path,
    is_legacy_draft,
    iter_nodes,
    validator_class,
)


@dataclass(frozen=True, slots=True)
class SchemaIssue:
    keyword: str
    path: str
    detail: str = ""

    def message(self) -> str:
        if not self.keyword:                     # the schema as a whole (size, depth)
            return f"unsupported JSON Schema at {self.path} ({self.detail})"
        text = f"unsupported JSON Schema keyword '{self.keyword}' at {self.path}"
        return f"{text} ({self.detail})" if self.detail else text


class UnsupportedSchemaError(ValueError):
    """The schema is valid but a backend cannot enforce some of its keywords."""

    def __init__(self, issues: list[SchemaIssue], backend: str):
        assert issues
        self.issues = issues
        self.backend = backend
        more = f"; and {len(issues) - 1} more" if len(issues) > 1 else ""
        super().__init__(f"{issues[0].message()}{more} [backend: {backend}]")


def _meta_valid_fast(schema: dict) -> bool:
    """jsonschema-rs's meta-schema check: ~250x faster than python-jsonschema's
    check_schema (12 ms of GIL-holding Python for a 60-property schema, run by the
    gateway per request and again by the engine's compile threads) and in
    agreement with it on every schema of ../shared/corpus (607 of 607). Only a
    "valid" answer is taken; anything else goes to python-jsonschema."""
    try:
        return jsonschema_rs.meta.is_valid(schema)
    except Exception:  # noqa: BLE001 - a draft or shape it does not know: the slow path
        return False


def check_metaschema(schema: Any) -> None:
    """Raise ValueError unless `schema` is valid against its draft's meta-schema and
    its bounds can be met."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError("invalid JSON Schema at $: a schema must be an object or a boolean")
    if _meta_valid_fast(schema):
        check_bounds(schema)
        return
    cls = validator_class(schema)          # invalid, or not known to the fast check:
    try:                                   # python-jsonschema says where and why
        cls.check_schema(schema)
    except jsonschema.SchemaError as err:
        path = "$"
        for key in err.absolute_path:
            path = child_path(path, key)
        raise ValueError(f"invalid JSON Schema at {path}: {err.message}") from None
    check_bounds(schema)


_BOUND_PAIRS = (("minLength", "maxLength", "string"), ("minItems", "maxItems", "array"),
                ("minProperties", "maxProperties", "object"), ("minimum", "maximum", "number"),
                ("minContains", "maxContains", "array"))


def check_bounds(schema: Any) -> None:
    """Raise ValueError naming the keyword and path of a lower bound above its upper
    bound (`minLength: 5, maxLength: 2`): valid JSON Schema, but nothing can meet it."""
    if not isinstance(schema, dict):
        return
    for node in iter_nodes(schema):
        for lo, hi, what in _BOUND_PAIRS:
            a, b = node.schema.get(lo), node.schema.get(hi)
            if _number(a) and _number(b) and a > b:
                raise ValueError(f"invalid JSON Schema at {node.path}: {lo} {a} > {hi} {b}, "
                                 f"no {what} satisfies both")
        if empty := _empty_number_range(node.schema) or _no_multiple_in_range(node.schema):
            raise ValueError(f"invalid JSON Schema at {node.path}: {empty}")


def _empty_number_range(node: dict) -> str:
    """'' unless the node's numeric bounds, exclusive ones included, admit no value
    that jsonschema would pass: no integer for an integer node (`exclusiveMinimum:
    0, exclusiveMaximum: 1`), no binary float otherwise (`exclusiveMinimum: 0,
    exclusiveMaximum: 5e-324`: no double lies between them). Not an error of the
    meta-schema, yet a backend given such a range may build a rule that matches
    nothing, and xgrammar's matched the empty text: outputs that were not JSON."""
    lows, highs = [], []
    for kw, inclusive, out in (("minimum", "exclusiveMinimum", lows),
                               ("maximum", "exclusiveMaximum", highs)):
        v, ex = node.get(kw), node.get(inclusive)
        if _number(v):
            out.append((kw, v, ex is True))          # draft 4: a boolean beside it
        if _number(ex):
            out.append((inclusive, ex, True))
    if not lows or not highs:
        return ""
    t = node.get("type")
    types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else {"number"}
    if not types or not types <= {"number", "integer"}:
        return ""                   # a value of another type may still pass (or none is a number)
    integers = "number" not in types
    least = [_least(v, strict, integers) for _, v, strict in lows]
    if None not in least and all(_fits_below(max(least), v, strict) for _, v, strict in highs):
        return ""
    (lo_kw, lo, _), (hi_kw, hi, _) = lows[-1], highs[-1]
    return (f"{lo_kw} {lo} and {hi_kw} {hi}: no {'integer' if integers else 'number'} "
            "lies between them")


def _no_multiple_in_range(node: dict) -> str:
    """'' unless a bounded numeric node's `multipleOf` has no multiple between its
    bounds (`minimum: 3, maximum: 4, multipleOf: 5`; beside `type: integer`, an
    integer multiple of 2.5 is a multiple of 5, so `minimum = maximum = 2^53` holds
    none). Numbers are read as the decimals they are written as, as the backends
    write them. llguidance found some such ranges only at the first decoding step
    (the request then failed in flight, a stream after its 200) and named `type`
    for the others; this names `multipleOf` before anything runs."""
    step = node.get("multipleOf")
    if not _number(step) or step <= 0 or isinstance(step, float) and not math.isfinite(step):
        return ""
    t = node.get("type")               # untyped: a string or an object still passes
    types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()
    if not types or not types <= {"number", "integer"}:
        return ""
    exact = Fraction(repr(step))       # the decimal written (an int's repr is itself)
    if "number" not in types:          # k * p/q is an integer only where q divides k
        exact = Fraction(exact.numerator)
    lows, highs = [], []               # least and greatest k admitted by each bound
    for kw, excl, out, rounding in (("minimum", "exclusiveMinimum", lows, math.ceil),
                                    ("maximum", "exclusiveMaximum", highs, math.floor)):
        v, ex = node.get(kw), node.get(excl)
        bounds = ([(v, ex is True)] if _number(v) else []) + ([(ex, True)] if _number(ex) else [])
        for b, strict in bounds:
            if isinstance(b, float) and not math.isfinite(b):
                continue
            q = Fraction(repr(b)) / exact
            k = rounding(q)
            if strict and k == q:
                k += 1 if rounding is math.ceil else -1
            out.append(k)
    if not lows or not highs or max(lows) <= min(highs):
        return ""
    kind = "integer" if "number" not in types else "number"
    return (f"multipleOf {step}: no {kind} between the node's bounds is a multiple of it")


def _least(v: float, strict: bool, integers: bool) -> Fraction | None:
    """The least integer, or finite binary float, at (or, `strict`, above) `v`,
    exactly; None where no finite float is."""
    if integers:
        return Fraction(math.floor(v) + 1 if strict else math.ceil(v))
    try:
        f = float(v)
    except OverflowError:                            # an integer past every double
        return None if v > 0 else Fraction(-sys.float_info.max)
    if math.isinf(f):
        return None if f > 0 else Fraction(-sys.float_info.max)
    while Fraction(f) < Fraction(v) or strict and Fraction(f) == Fraction(v):
        f = math.nextafter(f, math.inf)
        if math.isinf(f):
            return None
    while True:                                      # float() may have rounded upward
        below = math.nextafter(f, -math.inf)
        if Fraction(below) > Fraction(v) or not strict and Fraction(below) == Fraction(v):
            f = below
        else:
            return Fraction(f)


def _fits_below(x: Fraction, v: float, strict: bool) -> bool:
    return x < Fraction(v) if strict else x <= Fraction(v)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


RuleFn = Callable[[SchemaNode, Any, Any], list[tuple[str, str]]]
_RULES: dict[str, tuple[RuleFn, ...]] = {
    "xgrammar": (common_issues, xgrammar_only_issues),
    "outlines": (common_issues, outlines_only_issues),
}


def find_issues(schema: Any, backend: str) -> list[SchemaIssue]:
    """Keywords of `schema` (already meta-schema valid) that `backend` cannot enforce."""
    if schema is False:
        return [SchemaIssue("false", "$", "the schema admits no value")]
    if not isinstance(schema, dict):
        return []
    rules = _RULES[backend]
    validator = validator_class(schema)(schema)
    legacy = is_legacy_draft(schema)
    issues: list[SchemaIssue] = []
    for node in iter_nodes(schema):
        if legacy and "$ref" in node.schema:   # drafts 3-7: `$ref` siblings mean nothing
            issues += [SchemaIssue(kw, node.path, d) for kw, d in ref_issues(node.schema, schema)]
            continue
        for rule in rules:
            try:
                issues += [SchemaIssue(kw, node.path, detail)
                           for kw, detail in rule(node, schema, validator)]
            except referencing.exceptions.Unresolvable as err:
                # A rule that validates values (enum against its siblings, oneOf
                # branches) met a `$ref` that points nowhere: that ref is the issue
                # (it raised out of the check, a 500 on the server, before).
                issues.append(SchemaIssue("$ref", node.path, "cannot resolve a $ref met here "
                                          f"({getattr(err, 'ref', '?')!r}): nothing there"))
    if backend == "outlines":
        issues += [SchemaIssue(kw, path, detail) for kw, path, detail in recursive_ref_issues(schema)]
    return issues


def locate_keyword(schema: Any, keyword: str) -> str:
    """JSON path of the first reachable node holding `keyword` ("$" if none does)."""
    return next((node.path for node in iter_nodes(schema) if keyword in node.schema), "$")


# Keywords that make a regex out of a schema: where a backend's complaint about its
# regex or vocabulary names no keyword, these are what the schema can change.
_REGEX_KEYWORDS = ("pattern", "format", "const", "enum", "maxLength", "minLength")


def native_schema_error(schema: Any, message: str, backend: str) -> UnsupportedSchemaError:
    """A backend's own compile error for `schema` as keyword + JSON path: the first
    keyword of the schema the message names (word match, e.g. "Integer exceeds
    maximum limit" -> maximum), else the first regex-making keyword the schema
    has, else its root `type`."""
    present = {kw for node in iter_nodes(schema) for kw in node.schema} if isinstance(schema, dict) \
        else set()
    words = re.findall(r"[A-Za-z$]+", message)
    named = [w for w in words if w in present and (w in ASSERTION_KEYWORDS or w == "format")]
    keyword = (named[0] if named else next((k for k in _REGEX_KEYWORDS if k in present), "type"))
    detail = f"{backend}: {message.strip().splitlines()[0]}"
    return UnsupportedSchemaError([SchemaIssue(keyword, locate_keyword(schema, keyword), detail)],
                                  backend)


def check_schema(schema: Any, backend: str) -> Any:
    """Meta-schema check; return `schema`, or an equivalent rewrite of it
    (`schema_normalize`), that `backend` enforces exactly. Otherwise raise
    UnsupportedSchemaError listing what `backend` drops (paths into `schema`)."""
    check_metaschema(schema)
    if backend == "xgrammar":
        schema = map_subschemas(schema, _xgrammar_format)
    issues = find_issues(schema, backend)
    if not issues:
        return _backend_view(schema, backend)
    rewritten = normalize(schema)
    if rewritten is not schema and not find_issues(rewritten, backend):
        return _backend_view(rewritten, backend)
    raise UnsupportedSchemaError(issues, backend)


def _xgrammar_format(node: dict) -> dict:
    """A format xgrammar lacks as the narrower one it enforces (XGRAMMAR_NARROWER_FORMAT)."""
    fmt = node.get("format")
    narrower = XGRAMMAR_NARROWER_FORMAT.get(fmt) if isinstance(fmt, str) else None
    return node | {"format": narrower} if narrower else node


def _backend_view(schema: Any, backend: str) -> Any:
    """Exact rewrites a backend needs to enforce what it was checked for.
    xgrammar: lengths its format grammars imply are dropped (it would warn about
    them and ignore them; the format alone enforces them), and plain string
    lengths become a pattern it enforces without admitting control characters.
    outlines: keywords of types the node's `type` excludes are dropped (it would
    build an object regex for `type: array` next to `properties`), and patterns
    get the classes both JSON Schema (ECMA-262) and Python's `re` read in them
    (regex_classes.py)."""
    if backend == "xgrammar":
        return map_subschemas(schema, lambda node: lengths_as_plain_pattern(
            drop_implied_lengths(node, XGRAMMAR_FORMAT_LENGTHS)))
    return map_subschemas(schema, lambda node: portable_pattern(drop_inapplicable(node)))


def portable_pattern(node: dict, either: bool = False, json_string: bool = False,
                     rust_sets: bool = False) -> dict:
    """`node` with its `pattern`'s classes spelled out (`portable_classes`)."""
    pattern = node.get("pattern")
    if not isinstance(pattern, str):
        return node
    return node | {"pattern": portable_classes(pattern, either, json_string, rust_sets)}

"""Backend views of a schema that keep its meaning or narrow it, for keywords a
backend implements only in part (applied by the backend to what it compiles):
- `backend_format`: a `format` no draft defines annotates only and is dropped;
  a defined one the backend lacks becomes a narrower one it has, if any (a
  `uri-reference`: a `uri` or a relative reference, `RELATIVE_REF`);
- `raise_lowest_bound`: a lower bound below what the backend can build is
  raised (stricter: only the lowest numbers are lost);
- `exact_dates`: `date`, `date-time` and `time` also get a pattern that says
  exactly what jsonschema's format checker accepts (RFC 3339 with days that
  exist: no 2021-02-29, no year 0000), minus leap seconds (none is generated:
  stricter); the backend's own format admitted all three kinds.
- `float_multiple_of`: a decimal `multipleOf` such as 0.01 keeps to the numbers
  that jsonschema's float check passes too (below).
- `float_safe_bounds`: numeric bounds as inclusive ones of at most 15
  significant digits, just inside the original (below);
- `bound_truncations`: the numbers llguidance's range regex refuses under a
  bound with fraction digits (0.9 under `maximum: 0.95`), added back;
- `number_forms`: `bound_truncations`, and for a fractional `multipleOf` of two or
  more digits (0.25) its multiples written with fewer digits (`10.5`, `10.0`)
  added back: llguidance writes every fraction with exactly the step's digits.
Inputs are not mutated.
"""
from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_DOWN, ROUND_FLOOR, Decimal
from fractions import Fraction
from typing import Any


# Formats some JSON Schema draft defines; draft 3's own are honoured only there.
SPEC_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname",
    "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template",
    "json-pointer", "relative-json-pointer", "regex"})
DRAFT3_FORMATS = frozenset({"host-name", "ip-address", "color", "utc-millisec", "style", "phone"})
# A defined format whose language contains the other's: generating the narrower
# one is sound (an absolute URI is a URI-reference and an IRI; an ASCII address an
# internationalized one). Draft 3's names for later formats.
NARROWER_FORMAT = {"iri": "uri", "idn-email": "email"}
DRAFT3_ALIASES = {"host-name": "hostname", "ip-address": "ipv4"}
# RFC 3986's relative-ref without an authority ("//host..."): path-absolute,
# path-noscheme or empty, then ?query and #fragment; ASCII, percent-encoded. With an
# absolute `uri` beside it (anyOf), a `uri-reference` admits relative references
# ("../a.json#/defs/x", "/path?q=1"), which narrowing it to `uri` refused.
_PCHAR = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})"
_PCHAR_NC = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=@]|%[0-9A-Fa-f]{2})"   # no ":" (not a scheme)
_QUERY = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/?]|%[0-9A-Fa-f]{2})*"
RELATIVE_REF = (rf"^(?:/(?:{_PCHAR}+(?:/{_PCHAR}*)*)?|{_PCHAR_NC}+(?:/{_PCHAR}*)*)?"
                rf"(?:\?{_QUERY})?(?:#{_QUERY})?$")
REFERENCE_FORMATS = ("uri-reference", "iri-reference")


def backend_format(node: dict, supported: frozenset[str], draft3: bool) -> dict:
    """`node` with its `format` as a backend that implements `supported` can serve
    it exactly: a format no draft defines (for the schema's draft) annotates only
    (every validator accepts any string for it) and is dropped; a defined one the
    backend lacks becomes a supported narrower one where there is one; otherwise
    `node` is returned unchanged (and the backend refuses it)."""
    fmt = node.get("format")
    if not isinstance(fmt, str) or fmt in supported:
        return node
    defined = SPEC_FORMATS | DRAFT3_FORMATS if draft3 else SPEC_FORMATS
    if fmt not in defined:
        rest = {k: v for k, v in node.items() if k != "format"}
        if fmt in INTEGER_WIDTHS:
            return _integer_width(rest, INTEGER_WIDTHS[fmt])
        if fmt in UUID_VERSIONS:
            return _conjoin(rest, "pattern", UUID_VERSIONS[fmt]) if _is_string(rest) else rest
        if fmt == "ipvanyaddress" and {"ipv4", "ipv6"} <= supported and _is_string(rest):
            return _conjoin(rest, "anyOf", [{"format": "ipv4"}, {"format": "ipv6"}])
        return rest
    if fmt in REFERENCE_FORMATS and "uri" in supported:
        rest = {k: v for k, v in node.items() if k != "format"}
        return _conjoin(rest, "anyOf", [{"format": "uri"}, {"pattern": RELATIVE_REF}])
    narrower = (DRAFT3_ALIASES.get(fmt) if draft3 else None) or NARROWER_FORMAT.get(fmt)
    return node | {"format": narrower} if narrower in supported else node


# OpenAPI's integer formats (no JSON Schema draft defines them: annotations for a
# validator). A model wrote 30 digits under `format: int64`, which a client's int64
# field cannot hold; their ranges are generated instead (stricter, as valid).
INTEGER_WIDTHS = {"int32": 31, "int64": 63}


# pydantic's own names (annotations for a JSON Schema validator; its validators
# check them): `UUID4` is {"format": "uuid4"}, `IPvAnyAddress` "ipvanyaddress". Left
# as annotations, a walk wrote "({} expose" for an IPvAnyAddress field and any
# string for a UUID4 one, which the client's model_validate_json then refused. Served
# as what pydantic takes (stricter, as valid): an RFC 4122 UUID of that version (its
# `version` is None for another variant), an IPv4 or IPv6 address.
UUID_VERSIONS = {f"uuid{v}": (f"^[0-9a-fA-F]{{8}}-[0-9a-fA-F]{{4}}-{v}[0-9a-fA-F]{{3}}"
                              f"-[89abAB][0-9a-fA-F]{{3}}-[0-9a-fA-F]{{12}}$")
                 for v in range(1, 9)}


def _is_string(node: dict) -> bool:
    return node.get("type") == "string"


def _integer_width(node: dict, bits: int) -> dict:
    """`node` with its integers kept to [-2^bits, 2^bits - 1] (its own bounds kept)."""
    t = node.get("type")
    if not (t == "integer" or isinstance(t, list) and "integer" in t and "number" not in t):
        return node
    lo, hi = node.get("minimum"), node.get("maximum")
    out = dict(node)
    if not is_number(lo) or lo < -2 ** bits:
        out["minimum"] = -2 ** bits
    if not is_number(hi) or hi > 2 ** bits - 1:
        out["maximum"] = 2 ** bits - 1
    return out


_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"   # not 0000
_LEAP = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
         f"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)")
_TIME = ("(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:[.][0-9]+)?"
         "(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
DATE_PATTERNS = {"date": f"^{_DATE}$", "date-time": f"^{_DATE}[Tt]{_TIME}$", "time": f"^{_TIME}$"}
# Draft 3's `time` is "%H:%M:%S" without an offset (jsonschema: strptime).
_DRAFT3_TIME = "^(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]$"


def _conjoin(node: dict, key: str, value: Any) -> dict:
    """`node` that also asserts `{key: value}`: as its own keyword where `node` has
    none, else through `allOf` (both hold)."""
    if key not in node:
        return node | {key: value}
    all_of = node["allOf"] if isinstance(node.get("allOf"), list) else []
    return node | {"allOf": [*all_of, {key: value}]}


def exact_dates(node: dict, draft3: bool) -> dict:
    """`node` with a date/time `format` narrowed by the pattern that makes it exact
    (`DATE_PATTERNS`); beside an existing pattern, through `allOf` (both hold).
    Draft 3's `time` becomes its pattern alone (the backends' `time` wants an
    offset, which draft 3's refuses)."""
    fmt = node.get("format")
    if draft3 and fmt == "time":
        narrow, node = _DRAFT3_TIME, {k: v for k, v in node.items() if k != "format"}
    elif isinstance(fmt, str) and fmt in DATE_PATTERNS:
        narrow = DATE_PATTERNS[fmt]
    else:
        return node
    return _conjoin(node, "pattern", narrow)


def raise_lowest_bound(node: dict, lowest: int) -> dict:
    """`minimum`/`exclusiveMinimum` below `lowest` raised to it: stricter (only
    numbers below `lowest` are lost), for a backend that cannot build a range
    reaching further down. Left alone when that would empty the range."""
    out = node
    upper = [node[k] for k in ("maximum", "exclusiveMaximum") if is_number(node.get(k))]
    for kw in ("minimum", "exclusiveMinimum"):
        if is_number(node.get(kw)) and node[kw] < lowest and all(u > lowest for u in upper):
            out = out | {kw: lowest}
    return out


# Significant digits of a numeric bound llguidance reads exactly: past 15 it rounds
# the bound (measured: `maximum: 0.19999999999999998` admitted 0.199999999999999981).
_BOUND_DIGITS = 15
_BOUND_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})


def float_safe_bounds(node: dict) -> dict:
    """Numeric bounds of a node that may be a non-integer number, as inclusive
    bounds of at most 15 significant digits that every reading keeps to: stricter
    by at most one unit in the 15th digit.

    llguidance reads a number as the decimal written, jsonschema as the nearest
    binary float: under `exclusiveMaximum: 1` the decimal 0.99999999999999999999 is
    below 1, yet it reads as 1.0, which the bound refuses (so did
    `exclusiveMinimum: 0` for a 0. followed by 330 zeros and a 1). And llguidance
    rounds a bound of 16 or more digits (`maximum: 0.19999999999999998` admitted
    0.199999999999999981). So an upper bound becomes the decimal of 15 digits at or
    below it, an exclusive one a further unit in the 15th digit below (a gap wider
    than any float's spacing there, so the float of every decimal at or under the
    new bound lies under the old one: rounding is monotonic); lower bounds alike,
    upward. Draft 4's boolean `exclusiveMinimum`/`exclusiveMaximum` are read as
    such. A number written without a fraction reads as an exact int, so
    integer-only nodes keep their bounds, unless one is past 2^53 (`_integer_bounds`)."""
    if not _BOUND_KEYWORDS & node.keys():
        return node
    if node.get("type") in ("integer", ["integer"]):
        return _integer_bounds(node)
    out = dict(node)
    for exclusive, inclusive, upper in (("exclusiveMinimum", "minimum", False),
                                        ("exclusiveMaximum", "maximum", True)):
        flag = out.get(exclusive)
        bounds = []
        if is_number(out.get(inclusive)):
            bounds.append(_inside(out[inclusive], upper, strict=flag is True))
        if is_number(flag):
            bounds.append(_inside(flag, upper, strict=True))
        if isinstance(flag, bool) or is_number(flag):
            del out[exclusive]
        if bounds and all(b is not None for b in bounds):
            out[inclusive] = min(bounds) if upper else max(bounds)
    return node if out == node else out


_INT64_MAX = 2 ** 63 - 1


def _integer_bounds(node: dict) -> dict:
    """An integer-only node whose bounds reach past 2^53, with inclusive bounds that
    llguidance reads exactly: it reads a bound as a 64-bit float, so 9007199254740993
    became 9007199254740992 (under `minimum` = `maximum` = 9007199254740993 it wrote
    the integer below the minimum, and under 123456789012345678 one above the
    maximum; 2^63 - 1, read as 2^63, it takes down to 2^63 - 1 again). The bounds
    become the nearest integers inside them that a float holds exactly: stricter by
    less than the spacing of floats there (a range left empty is then refused, and
    auto serves the node with xgrammar, which reads it exactly). Other nodes are
    returned as they are."""
    def exact(v: Any) -> bool:
        return not is_number(v) or isinstance(v, int) and (abs(v) <= 2 ** 53 or float(v) == v
                                                           or v >= _INT64_MAX) \
            or isinstance(v, float) and abs(v) <= 2 ** 53
    if all(exact(node.get(k)) for k in _BOUND_KEYWORDS):
        return node
    lows, highs = [], []
    for exclusive, inclusive, out, step in (("exclusiveMinimum", "minimum", lows, 1),
                                            ("exclusiveMaximum", "maximum", highs, -1)):
        flag, v = node.get(exclusive), node.get(inclusive)
        if is_number(v) and math.isfinite(v):
            q = Fraction(v)
            edge = math.ceil(q) if step > 0 else math.floor(q)
            out.append(edge + step if flag is True and edge == q else edge)
        if is_number(flag) and math.isfinite(flag):
            q = Fraction(flag)
            edge = math.floor(q) + 1 if step > 0 else math.ceil(q) - 1
            out.append(edge)
    out_node = {k: v for k, v in node.items() if k not in _BOUND_KEYWORDS}
    if lows:
        out_node["minimum"] = _held_inward(max(lows), up=True)
    if highs:
        out_node["maximum"] = _held_inward(min(highs), up=False)
    return out_node


def _held_inward(v: int, up: bool) -> int:
    """The integer nearest `v` (at or above it if `up`, else at or below) that a
    64-bit float holds exactly; an upper bound at or past 2^63 - 1 as it is (read as
    the float 2^63, which llguidance takes down to 2^63 - 1: exact, or stricter)."""
    if not up and v >= _INT64_MAX:
        return v
    f = float(v)
    if up and f < v:
        f = math.nextafter(f, math.inf)
    elif not up and f > v:
        f = math.nextafter(f, -math.inf)
    return int(f)


def _inside(bound: int | float, upper: bool, strict: bool) -> float | None:
    """`bound` rounded inward to 15 significant digits, and one unit further when
    `strict`; None for a bound that is not finite."""
    if not math.isfinite(bound):
        return None
    value = Decimal(repr(float(bound)) if isinstance(bound, float) else bound)
    unit = Decimal(1).scaleb(value.adjusted() - _BOUND_DIGITS + 1)
    rounded = value.quantize(unit, rounding=ROUND_FLOOR if upper else ROUND_CEILING)
    if strict:
        rounded = rounded - unit if upper else rounded + unit
    return float(rounded)


# Keywords a number node may carry for `bound_truncations` to rewrite it.
_NUMBER_NODE = frozenset({"type", "minimum", "maximum", "multipleOf", "title", "description",
                          "default", "examples", "$comment", "format"})


def bound_truncations(node: dict) -> dict:
    """A `number` node whose bound has fraction digits, with the numbers llguidance
    1.9 refuses below it added back. Its range regex refuses a number whose
    fraction is a proper prefix of the bound's on the side away from zero:
    `maximum: 0.95` refused 0.9, `maximum: 10.25` refused 10.2, `minimum: -0.95`
    refused -0.9 (0.90, 0.94 and 10.24 pass). Those truncations, where the node
    admits them, become an `enum` branch: {"anyOf": [node, {"enum": [...]}]}.
    Only plain number nodes (the keywords above) are rewritten."""
    if node.get("type") not in ("number", ["number"]) or not node.keys() <= _NUMBER_NODE:
        return node
    lo, hi = node.get("minimum"), node.get("maximum")
    m = node.get("multipleOf")
    values = []
    for bound, away in ((hi, 1), (lo, -1)):
        if not is_number(bound) or not math.isfinite(bound) or bound * away <= 0:
            continue
        value = Decimal(repr(float(bound)))
        for places in range(1, -value.as_tuple().exponent):
            cut = float(value.quantize(Decimal(1).scaleb(-places), rounding=ROUND_DOWN))
            inside = (not is_number(lo) or cut >= lo) and (not is_number(hi) or cut <= hi)
            if inside and cut != bound and (m is None or _divides(cut, m)):
                values.append(cut)
    if not values:
        return node
    return {"anyOf": [node, {"type": "number", "enum": sorted(set(values))}]}


# Keywords that hold subschemas or name a schema resource: a node carrying one is
# not copied into `anyOf` branches (refs and anchors would resolve elsewhere).
_NOT_COPIED = frozenset({
    "$ref", "$dynamicRef", "$recursiveRef", "anyOf", "oneOf", "allOf", "not", "if", "then",
    "else", "items", "prefixItems", "additionalItems", "contains", "properties",
    "patternProperties", "additionalProperties", "propertyNames", "dependentSchemas",
    "dependencies", "unevaluatedProperties", "unevaluatedItems", "$defs", "definitions", "$id",
    "id", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$schema"})


def number_forms(node: dict) -> dict:
    """`bound_truncations(node)`, and for a node typed `number` (alone or beside other
    types, no subschemas) whose `multipleOf` s is a fraction of two or more digits,
    the same node at 2s, 4s, ... beside it.

    llguidance writes a multiple of s = 0.25 as an integer or with exactly two
    fraction digits: `10.50` and `10.00`, never `10.5` or `10.0` (what `json.dumps`
    and most writers print). With s = p / 2^a (p odd: a dyadic step, as
    `float_multiple_of` leaves it) a multiple N*s whose N holds 2^k is a multiple
    of 2^k * s, a step of exactly a - k digits, which llguidance writes in that many
    digits. So `anyOf` of the node at s, 2s, ... 2^(a-1)s admits each multiple in
    its shortest form and in a digits, and nothing else: every branch's numbers are
    multiples of s, and what is not a number each branch admits alike (exact, not
    just stricter)."""
    m = node.get("multipleOf")
    t = node.get("type")
    if not isinstance(m, float) or m <= 0 or m.is_integer() or node.keys() & _NOT_COPIED \
            or not (t == "number" or isinstance(t, list) and "number" in t):
        return bound_truncations(node)
    step = Fraction(m)
    if step.denominator & (step.denominator - 1) or step.denominator == 2:
        return bound_truncations(node)          # not dyadic, or already one digit
    branches = []
    while step.denominator > 1:
        form = bound_truncations(node | {"multipleOf": float(step)})
        branches += form["anyOf"] if "anyOf" in form else [form]
        step *= 2
    return {"anyOf": branches}


def _divides(value: float, m: Any) -> bool:
    """jsonschema's multipleOf test for a float instance (an enum value is not
    checked by the backend, so it must pass the judge's own test)."""
    if not is_number(m) or m <= 0:
        return False
    if isinstance(m, float):
        quotient = value / m
        return math.isfinite(quotient) and int(quotient) == quotient
    return value % m == 0


def is_number(x: Any) -> bool:
    """A JSON number (bool is not one)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def float_multiple_of(node: dict) -> dict | None:
    """`node` with a decimal `multipleOf` narrowed to what jsonschema passes, or None
    when nothing sound is left to generate.

    jsonschema checks a float `multipleOf` m as `int(v / m) == v / m` in binary
    floating point: with m = 0.01, 19.99 / 0.01 = 1998.9999999999998, so 19.99, 0.07
    and 0.3 fail (321 of the first 1,999 multiples of 0.01), although the backend,
    reading decimals, generates them. Where float(m) is m exactly (0.5, 0.125, 2.5)
    every multiple divides exactly: unchanged. Otherwise, if float(m) is within 2^-54
    of m (relative: 0.01, 0.1, 0.05, 0.3, 0.001, 1e-06, ...), then for every float v
    that is exactly a decimal multiple N of m the quotient v / float(m) rounds to N
    itself (its error, N * 2^-54, is under half an ulp of N). The decimal multiples
    that are floats exactly are the multiples of p / 2^a, where m = p / (2^a 5^b)
    reduced (0.01 = 1/100: the quarters; 0.1: the halves; 0.3: multiples of 1.5;
    0.001: eighths); and past 2^51, where floats are spaced wider than that, every
    float is such a multiple. So a number node keeps to multiples of p / 2^a
    (integer nodes to multiples of p): stricter, and valid under both readings.
    Past 2^-54 (0.07, 0.7, 1e-05) even integers fail (checked: 42,713 of 200,000
    for 0.7): None. A step of more than MAX_STEP_DIGITS fraction digits (1e-09 ->
    1/512, or 2^-9 itself) is coarsened to its smallest multiple that has at most
    that many (1/256): llguidance's own check is unsound past them (below)."""
    m = node.get("multipleOf")
    if not isinstance(m, float) or m <= 0 or m.is_integer():
        return node
    decimal = Fraction(repr(m))
    error = abs(Fraction(m) - decimal) / decimal
    if error > Fraction(1, 2 ** 54):
        return None
    if error == 0 and _within_scale(decimal) == decimal:
        return node
    t = node.get("type")
    numbers = t is None or t == "number" or isinstance(t, list) and "number" in t
    if not numbers:
        step = Fraction(decimal.numerator)
    else:
        twos = decimal.denominator & -decimal.denominator       # 2^a
        step = _within_scale(Fraction(decimal.numerator, twos))
    if step.denominator > 1 and Fraction(float(step)) != step:
        return None                     # a numerator past 2^53: no float says it
    return node | {"multipleOf": int(step) if step.denominator == 1 else float(step)}


# llguidance 1.9 checks `multipleOf` d * 10^-s (its decimal digits d, its fraction
# digits s) with u32 arithmetic: from s = 9 on it admits non-multiples (walks under
# 1/512 = 0.001953125: 21 of 61 outputs were not multiples; under 3e-10, 110 of
# 166), for every d > 1 tried; s <= 8 admitted none.
MAX_STEP_DIGITS = 8


def _within_scale(step: Fraction) -> Fraction:
    """The smallest multiple of `step` written in at most MAX_STEP_DIGITS fraction
    digits (`step` itself if it is): its multiples are multiples of `step`, so
    generating them is sound, only stricter (1/512 -> 1/256)."""
    return step * (step.denominator // math.gcd(step.denominator, 10 ** MAX_STEP_DIGITS))

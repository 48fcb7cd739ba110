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
Inputs are not mutated.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any

_TYPES = ("null", "boolean", "object", "array", "string", "integer")   # all but number


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
        return {k: v for k, v in node.items() if k != "format"}
    if fmt in REFERENCE_FORMATS and "uri" in supported:
        rest = {k: v for k, v in node.items() if k != "format"}
        return _conjoin(rest, "anyOf", [{"format": "uri"}, {"pattern": RELATIVE_REF}])
    narrower = (DRAFT3_ALIASES.get(fmt) if draft3 else None) or NARROWER_FORMAT.get(fmt)
    return node | {"format": narrower} if narrower in supported else node


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
    of m (relative: 0.01, 0.1, 0.05, 0.3, 0.001, 1e-06, ...), the quotient of an
    integer multiple N of m rounds to N itself (its error, N * 2^-54, is under half
    an ulp of N), so the node keeps to integers that are multiples of m (`multipleOf`
    the numerator of m as a reduced decimal fraction; `number` becomes `integer`):
    stricter, and valid under both readings. Past 2^-54 (0.07, 0.7, 1e-05) even
    integers fail (checked: 42,713 of 200,000 for 0.7): None."""
    m = node.get("multipleOf")
    if not isinstance(m, float) or m <= 0 or m.is_integer():
        return node
    decimal = Fraction(repr(m))
    error = abs(Fraction(m) - decimal) / decimal
    if error == 0:
        return node
    if error > Fraction(1, 2 ** 54):
        return None
    t = node.get("type")
    types = list(_TYPES) if t is None else [t] if isinstance(t, str) else list(t)
    types = list(dict.fromkeys("integer" if x == "number" else x for x in types))
    return node | {"multipleOf": decimal.numerator,
                   "type": types[0] if len(types) == 1 else types}

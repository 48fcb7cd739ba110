"""Backend views of a schema that keep its meaning or narrow it, for keywords a
backend implements only in part (applied by the backend to what it compiles):
- `backend_format`: a `format` no draft defines annotates only and is dropped;
  a defined one the backend lacks becomes a narrower one it has, if any;
- `raise_lowest_bound`: a lower bound below what the backend can build is
  raised (stricter: only the lowest numbers are lost).
Inputs are not mutated.
"""
from __future__ import annotations

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
NARROWER_FORMAT = {"uri-reference": "uri", "iri": "uri", "iri-reference": "uri",
                   "idn-email": "email"}
DRAFT3_ALIASES = {"host-name": "hostname", "ip-address": "ipv4"}


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
    narrower = (DRAFT3_ALIASES.get(fmt) if draft3 else None) or NARROWER_FORMAT.get(fmt)
    return node | {"format": narrower} if narrower in supported else node


def raise_lowest_bound(node: dict, lowest: int) -> dict:
    """`minimum`/`exclusiveMinimum` below `lowest` raised to it: stricter (only
    numbers below `lowest` are lost), for a backend that cannot build a range
    reaching further down. Left alone when that would empty the range."""
    out = node
    upper = [node[k] for k in ("maximum", "exclusiveMaximum") if _is_number(node.get(k))]
    for kw in ("minimum", "exclusiveMinimum"):
        if _is_number(node.get(kw)) and node[kw] < lowest and all(u > lowest for u in upper):
            out = out | {kw: lowest}
    return out


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)

"""Per-node rules: JSON Schema keywords a backend drops or weakens.

Each rule maps one schema node to `[(keyword, detail)]`; they judge a schema as
written, and `schema_normalize` may remove what they flag (e.g. `not` of
`required`, dependencies, if/then on a listed discriminator). Findings measured on
xgrammar 0.2.9 / outlines-core 0.2.14 (both ignore silently unless noted):
- both: not, if/then/else, dependentRequired/dependentSchemas/dependencies,
  uniqueItems, contains, non-local `$ref`, `$ref` siblings (2019-09+), keywords
  next to anyOf/oneOf/allOf, enum/const siblings, `required` names missing
  from `properties` of an object, oneOf not proven disjoint (treated as
  anyOf; proofs in schema_oneof), type-specific keywords on a node without `type`;
- xgrammar: `pattern` (compiled loosely inside JSON strings: `^\\d\\d(\\.\\d+)?$`
  admits "125"), string lengths it cannot take as a plain-character pattern
  (its own length grammar admits raw control characters), allOf with >1 branch,
  the date/time, ipv4/ipv6 and hostname formats (2021-02-29, "044.29.74.38"),
  minLength/maxLength next to pattern/format,
  multipleOf unless on a bounded-free integer, patternProperties (its names
  are compiled by the same loose converter as `pattern`: `^a(bc+)?$` admitted
  the name "acc"), propertyNames next to properties, minProperties of 2 or
  more that an `additionalProperties` schema's names could make up (a name may
  repeat: `{"a": 1, "a": 2}` passed `minProperties: 2`);
- outlines: a property that admits any value (`{}`: the regex it builds lacks
  parentheses), `\\D`/`\\W` inside a class (its classes are Unicode-aware;
  other `\\d`/`\\w` are spelled out as ASCII before it sees them), every numeric bound, multipleOf, min/maxProperties, allOf,
  propertyNames, patternProperties, lengths next to pattern/format (the
  pattern is dropped), patterns that can match a quote, backslash or control
  character (the output would not be JSON), formats but uuid, objects
  with more than 16 optional properties (its regex builder runs out of memory).
"""
from __future__ import annotations

import json
from typing import Any

from formwork.grammar.regex_safety import has_top_level_alternation, pattern_is_json_safe
from formwork.grammar.schema_formats import NARROWER_FORMAT, is_number
from formwork.grammar.schema_lengths import MAX_FOLDED_COUNT, is_plain_length_pattern
from formwork.grammar.schema_oneof import (
    branches_imply_type,
    emitted_forms,
    inferred_types as _types,
    pairwise_disjoint,
)
from formwork.grammar.schema_values import inexact_values
from formwork.grammar.schema_walk import SchemaNode, is_legacy_draft, local_refs, resolve_local_ref

NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
STRING = ("minLength", "maxLength", "pattern")
ARRAY = ("minItems", "maxItems", "uniqueItems", "contains", "minContains", "maxContains",
         "unevaluatedItems")
OBJECT = ("required", "minProperties", "maxProperties", "propertyNames", "patternProperties",
          "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties")
APPLICATORS = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref",
               "$dynamicRef", "$recursiveRef")
# Keywords that can make an instance invalid; all others annotate only.
ASSERTIONS = frozenset(NUMERIC + STRING + ARRAY + OBJECT + APPLICATORS + (
    "type", "enum", "const", "items", "prefixItems", "additionalItems", "properties",
    "additionalProperties"))
# Of outlines-core's built-in format regexes only these are sound inside a JSON
# string. Its `date` uses Unicode `\d` ("꘠4௬൫-10-11" passed), its `time` has
# `\\.` (a raw backslash then any character: "04:53:53\*41", not JSON), `uri`
# lets `"` through and `email` raw control characters; its `date-time` admits days
# that do not exist (2021-04-31, 2021-02-29, year 0000).
OUTLINES_FORMATS = frozenset({"uuid"})
# Measured: 17 optional properties made build_regex_from_schema exhaust 3 GB.
OUTLINES_MAX_OPTIONAL = 16
# Shortest and longest (None: unbounded) string, in code points, that xgrammar
# 0.2.9's grammar for each format admits (tests recompute them from its EBNF).
XGRAMMAR_FORMAT_LENGTHS = {"date": (10, 10), "time": (9, None), "date-time": (20, None),
                           "uuid": (36, 36), "ipv4": (7, 15), "email": (3, None)}
# Formats whose xgrammar 0.2.9 grammar admits what jsonschema's format checker
# refuses (measured: random walks under its mask, each output checked), an example each.
XGRAMMAR_LOOSE_FORMATS = {
    "date": "2021-02-29, 2021-04-31, 0000-01-01", "date-time": "2021-04-31T00:00:00Z",
    "time": "10:00:60Z (a leap second at any minute)", "ipv4": "044.29.74.38 (leading zeros)",
    "ipv6": "::5.75.216.04", "hostname": "labels longer than 63 characters",
    # not implemented by xgrammar: any string (measured: "a b" accepted); iri,
    # iri-reference and idn-email are served as their ASCII forms instead
    # (`XGRAMMAR_NARROWER_FORMAT`), which are sound narrowings
    "iri": "any string", "iri-reference": "any string", "idn-email": "any string",
    "idn-hostname": "any string", "regex": "any string"}
# A defined format xgrammar lacks -> one it enforces whose language is contained in it
# (as for llguidance; and a URI-reference is an IRI-reference).
XGRAMMAR_NARROWER_FORMAT = NARROWER_FORMAT | {"iri-reference": "uri-reference"}
Issues = list[tuple[str, str]]


def _siblings(node: dict, *keys: str) -> list[str]:
    return sorted(k for k in node if k in ASSERTIONS and k not in keys)


def common_issues(sn: SchemaNode, root: Any, validator: Any) -> Issues:
    node, out = sn.schema, []
    for kw in ("not", "if", "contains", "$dynamicRef", "$recursiveRef"):
        if kw in node:
            out.append((kw, "not enforced"))
    for kw in ("dependentRequired", "dependentSchemas", "dependencies"):
        if node.get(kw):
            out.append((kw, "not enforced"))
    if node.get("uniqueItems") is True:
        out.append(("uniqueItems", "not enforced"))
    out += ref_issues(node, root)
    for kw in ("anyOf", "oneOf", "allOf"):
        sib = _siblings(node, kw, "$ref")
        if kw in node and sib and not (sib == ["type"] and branches_imply_type(node, kw, root)):
            out.append((kw, f"keywords next to {kw} are ignored: {sib}"))
    if "oneOf" in node and not pairwise_disjoint(node["oneOf"], root, validator):
        out.append(("oneOf", "branches are not provably disjoint (would be treated as anyOf)"))
    out += _enum_issues(node, validator)
    out += _required_issues(node)
    if _types(node) is None:
        bare = [k for k in NUMERIC + STRING + ARRAY + OBJECT if k in node]
        out += [(k, "needs an explicit 'type' to be enforced") for k in bare]
    if isinstance(node.get("items"), list):
        out.append(("items", "tuple form of 'items'; use prefixItems"))
    return out


def duplicate_name_issues(node: dict, open_by_default: bool) -> Issues:
    """`minProperties` of 2 or more where undeclared or patterned names make up the
    count: the backends do not keep generated names apart, so `{"a": 1, "a": 2}`
    passed `minProperties: 2` in the mask, and jsonschema (like every JSON parser
    that keeps the last value) sees one name. `open_by_default`: the backend
    generates undeclared names where the node says nothing about them."""
    least = node.get("minProperties")
    if not isinstance(least, int) or isinstance(least, bool) or least < 2:
        return []
    extra = node.get("additionalProperties", True if open_by_default else False)
    if extra is False and not node.get("patternProperties"):
        return []
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    if len({r for r in required if r in props}) >= least:
        return []                    # the declared, required names alone make the count
    return [("minProperties", "a repeated undeclared name could make up the count "
                              "(generated names are not kept apart; jsonschema counts each "
                              "name once)")]


def ref_issues(node: dict, root: Any) -> Issues:
    ref = node.get("$ref")
    if ref is None:
        return []
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return [("$ref", f"cannot resolve {ref!r}: only refs within the schema are supported "
                         "('#' or a JSON pointer such as '#/$defs/Name')")]
    if resolve_local_ref(root, ref) is None:
        return [("$ref", f"cannot resolve {ref!r}: nothing at that JSON pointer from the "
                         "schema's root")]
    if not is_legacy_draft(root) and _siblings(node, "$ref"):
        return [("$ref", f"keywords next to $ref are ignored: {_siblings(node, '$ref')}")]
    return []


def _enum_issues(node: dict, validator: Any) -> Issues:
    """enum/const win over every sibling: fine only if each value satisfies them.
    Beside each other the backends keep one of the two (xgrammar `const`,
    outlines-core `enum`): each value of either must then pass the other."""
    if node.get("enum") == []:
        return [("enum", "an empty enum admits no value (outlines-core generated text "
                         "that is not JSON for one)")]
    both = "const" in node and "enum" in node
    kw = "const" if "const" in node else "enum" if "enum" in node else None
    if kw is None or not (both or _siblings(node, "enum", "const")):
        return []
    values = ([node["const"]] if "const" in node else []) + list(node.get("enum") or [])
    sub = validator.evolve(schema=node)
    bad = [v for v in values if not all(sub.is_valid(x) for x in emitted_forms(v))]
    if bad:
        return [(kw, f"value {json.dumps(bad[0])} violates sibling keywords, which are ignored")]
    return []


def _required_issues(node: dict) -> Issues:
    req = node.get("required")
    types = _types(node)
    if not isinstance(req, list) or (types is not None and "object" not in types):
        return []                    # `required` constrains objects only
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    missing = [r for r in req if r not in props]
    if missing:
        return [("required", f"required property {missing[0]!r} is not declared in 'properties'")]
    return []


# --- backend-specific -----------------------------------------------------------------

def xgrammar_only_issues(sn: SchemaNode, root: Any, validator: Any) -> Issues:
    node, out = sn.schema, []
    if "pattern" in node and not is_plain_length_pattern(node["pattern"]):
        out.append(("pattern", "xgrammar compiles a pattern inside a JSON string loosely "
                               "(^\\d\\d(\\.\\d+)?$ admits \"125\")"))
    elif "format" not in node and _plain_length_unfoldable(node):
        out.append(("maxLength" if "maxLength" in node else "minLength",
                    "xgrammar's length-bounded strings admit raw control characters; "
                    f"only bounds up to {MAX_FOLDED_COUNT} on a 'string'-typed node are rewritten"))
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        out.append(("allOf", "allOf with more than one branch is not enforced"))
    if node.get("format") in XGRAMMAR_LOOSE_FORMATS:
        out.append(("format", f"xgrammar's {node['format']!r} admits invalid values "
                              f"({XGRAMMAR_LOOSE_FORMATS[node['format']]})"))
    out += _length_next_to_pattern(node, XGRAMMAR_FORMAT_LENGTHS)
    if "multipleOf" in node:
        bounded = any(k in node for k in NUMERIC if k != "multipleOf")
        m = node["multipleOf"]
        if node.get("type") != "integer" or bounded or not float(m).is_integer():
            out.append(("multipleOf", "only enforced on an integer type without bounds"))
    out += duplicate_name_issues(node, open_by_default=False)
    if node.get("patternProperties"):
        out.append(("patternProperties", "xgrammar compiles a property-name pattern as loosely "
                                         "as a `pattern` (^a(bc+)?$ admits the name \"acc\")"))
    if "propertyNames" in node and node.get("properties"):
        out.append(("propertyNames", "not enforced next to 'properties'"))
    for kw in ("exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(node.get(kw), bool):
            out.append((kw, "draft-04 boolean form"))
    return out


def _plain_length_unfoldable(node: dict) -> bool:
    """String lengths that schema_rewrites.lengths_as_plain_pattern cannot rewrite."""
    bounds = [node[k] for k in ("minLength", "maxLength") if k in node]
    if not bounds:
        return False
    return node.get("type") != "string" or any(
        not isinstance(b, int) or isinstance(b, bool) or b > MAX_FOLDED_COUNT for b in bounds)


def _length_next_to_pattern(node: dict, format_lengths: dict | None = None) -> Issues:
    """`format_lengths`: {format: (shortest, longest or None)} the backend's format
    grammar generates; a length bound those imply needs no enforcing."""
    if "pattern" not in node and "format" not in node:
        return []
    other = "pattern" if "pattern" in node else "format"
    implied = (format_lengths or {}).get(node["format"]) if other == "format" else None
    out = []
    for k in ("minLength", "maxLength"):
        if k not in node:
            continue
        bound = node[k]
        if implied is not None and isinstance(bound, (int, float)) and not isinstance(bound, bool):
            if k == "minLength" and bound <= implied[0]:
                continue
            if k == "maxLength" and implied[1] is not None and bound >= implied[1]:
                continue
        out.append((k, f"not enforced together with '{other}'"))
    return out


def _admits_anything(schema: Any, root: Any) -> bool:
    """`true`, or a schema without assertions, also behind local `$ref`s (a property
    `{"$ref": "#/$defs/any"}` with `any: {}` got the same malformed regex)."""
    for _ in range(32):                    # a chain of refs, bounded (cycles included)
        if schema is True:
            return True
        if not isinstance(schema, dict):
            return False
        if set(schema) & ASSERTIONS != {"$ref"} or not isinstance(schema["$ref"], str):
            return not ASSERTIONS & schema.keys()
        target = resolve_local_ref(root, schema["$ref"])
        if target is None:
            return False
        schema = target[0]
    return False


def _recursive_ref(ref: Any, root: Any) -> bool:
    """Whether the local `$ref` leads, through the refs inside its target, back to
    that target (a recursive schema: a list, a tree)."""
    start = resolve_local_ref(root, ref) if isinstance(ref, str) else None
    if start is None:
        return False
    seen: set[int] = set()
    todo = [start[0]]
    while todo:
        node = todo.pop()
        for r in local_refs(node):
            target = resolve_local_ref(root, r)
            if target is None:
                continue
            if target[0] is start[0]:
                return True
            if id(target[0]) not in seen:
                seen.add(id(target[0]))
                todo.append(target[0])
    return False


def recursive_ref_issues(root: Any) -> list[tuple[str, str, str]]:
    """(keyword, path, detail) of the first recursive local `$ref` of the document, for
    outlines-core: at its recursion depth limit it wrote an object without its
    required members and with a trailing comma (`{"v": 3,}`: not JSON). Checked over
    the whole document, not per node: in drafts 3-7 a node with `$ref` gets no rules."""
    for ref in sorted(local_refs(root)):
        if _recursive_ref(ref, root):
            return [("$ref", resolve_local_ref(root, ref)[1],
                     f"the recursive $ref {ref!r}: at its depth limit outlines-core writes an "
                     "object without its required members and with a trailing comma (not JSON)")]
    return []


def outlines_only_issues(sn: SchemaNode, root: Any, validator: Any) -> Issues:
    node, out = sn.schema, []
    types = _types(node)
    numeric_ok = types is not None and not types & {"number", "integer"}
    if not numeric_ok:
        out += [(k, "numeric bounds are not enforced") for k in NUMERIC if k in node]
    for kw in ("minProperties", "maxProperties", "propertyNames", "patternProperties", "allOf"):
        if kw in node:
            out.append((kw, "not enforced"))
    for kw in ("unevaluatedProperties", "unevaluatedItems"):
        if kw in node and node[kw] is not False:
            out.append((kw, "only `false` is enforced"))
    out += [(k, "the pattern/format would be dropped") for k, _ in _length_next_to_pattern(node)]
    if "pattern" in node and "format" in node:       # it keeps the pattern
        out.append(("format", "not enforced together with 'pattern'"))
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else None
    if prefix is not None:                           # it writes exactly the prefix
        lo, hi = node.get("minItems"), node.get("maxItems")
        for kw, off in (("minItems", is_number(lo) and lo > len(prefix)),
                        ("maxItems", is_number(hi) and hi < len(prefix))):
            if off:
                out.append((kw, f"beside prefixItems outlines-core writes exactly the "
                                f"{len(prefix)} prefix items"))
    if isinstance(node.get("pattern"), str) and not pattern_is_json_safe(node["pattern"]):
        out.append(("pattern", "may match a quote, backslash or control character"))
    elif isinstance(node.get("pattern"), str) and has_top_level_alternation(node["pattern"]):
        out.append(("pattern", "an alternation outside any group (outlines-core writes the "
                               "pattern between the string's quotes without parentheses)"))
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    untyped = [k for k, v in props.items() if _admits_anything(v, root)]
    if untyped:
        out.append(("properties", f"property {untyped[0]!r} admits any value; outlines-core's "
                                  "regex for that is malformed (a bare value passes at the root)"))
    # the same unparenthesized any-value regex inside an array or as the undeclared
    # properties' value (`prefixItems: [{}, {const: 3}]` let "abc" through at the root)
    for kw, subs in (("prefixItems", prefix or []), ("items", [node.get("items")]),
                     ("additionalProperties", [node.get("additionalProperties")])):
        if any(isinstance(v, dict) and _admits_anything(v, root) for v in subs):
            out.append((kw, "an item or value that admits any value; outlines-core's regex for "
                            "that is malformed (a bare value passes at the root)"))
    escaped = [k for k in props if any(c in '"\\' or ord(c) < 0x20 for c in k)]
    if escaped:
        out.append(("properties", f"property name {escaped[0]!r} needs JSON escapes, which "
                                  "outlines-core writes raw (not JSON)"))
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in OUTLINES_FORMATS:
        out.append(("format", f"format {fmt!r} is not supported (outlines-core enforces "
                              f"only {sorted(OUTLINES_FORMATS)} exactly)"))
    if node.get("items") is False:
        out.append(("items", "`items: false` is not supported"))
    out += inexact_values(sn, "outlines")
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    if len([p for p in props if p not in required]) > OUTLINES_MAX_OPTIONAL:
        out.append(("properties", f"more than {OUTLINES_MAX_OPTIONAL} optional properties "
                                  "(outlines-core's regex for them explodes)"))
    return out

"""Per-node rules: JSON Schema keywords a backend drops or weakens.

Each rule maps one schema node to `[(keyword, detail)]`. Findings measured on
xgrammar 0.2.9 / outlines-core 0.2.14 (both ignore silently unless noted):
- both: not, if/then/else, dependentRequired/dependentSchemas/dependencies,
  uniqueItems, contains, non-local `$ref`, `$ref` siblings (2019-09+), keywords
  next to anyOf/oneOf/allOf, enum/const siblings, `required` names missing
  from `properties`, overlapping oneOf (treated as anyOf), type-specific
  keywords on a node without `type`;
- xgrammar: allOf with >1 branch, minLength/maxLength next to pattern/format,
  multipleOf unless on a bounded-free integer, several or overlapping
  patternProperties, propertyNames next to properties;
- outlines: every numeric bound, multipleOf, min/maxProperties, allOf,
  propertyNames, patternProperties, lengths next to pattern/format (the
  pattern is dropped), patterns that can match a quote, backslash or control
  character (the output would not be JSON), formats it does not know, objects
  with more than 16 optional properties (its regex builder runs out of memory).
"""
from __future__ import annotations

import json
import re
from typing import Any

from grammar.regex_safety import pattern_is_json_safe
from grammar.schema_walk import SchemaNode, is_legacy_draft, resolve_local_ref

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
OUTLINES_FORMATS = frozenset({"date-time", "date", "time", "uuid", "uri", "email"})
# Measured: 17 optional properties made build_regex_from_schema exhaust 3 GB.
OUTLINES_MAX_OPTIONAL = 16
Issues = list[tuple[str, str]]


def _types(node: dict) -> set[str] | None:
    """Explicit `type` as a set, or what xgrammar infers (object/array), or None."""
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return set(t)
    if "properties" in node or "additionalProperties" in node:
        return {"object"}
    if "items" in node or "prefixItems" in node:
        return {"array"}
    return None


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
        if kw in node and sib and not (sib == ["type"] and _branches_imply_type(node, kw, root)):
            out.append((kw, f"keywords next to {kw} are ignored: {sib}"))
    if "oneOf" in node and not _pairwise_disjoint(node["oneOf"], root):
        out.append(("oneOf", "branches are not provably disjoint (would be treated as anyOf)"))
    out += _enum_issues(node, validator)
    out += _required_issues(node)
    if _types(node) is None:
        bare = [k for k in NUMERIC + STRING + ARRAY + OBJECT if k in node]
        out += [(k, "needs an explicit 'type' to be enforced") for k in bare]
    if isinstance(node.get("items"), list):
        out.append(("items", "tuple form of 'items'; use prefixItems"))
    return out


def ref_issues(node: dict, root: Any) -> Issues:
    ref = node.get("$ref")
    if ref is None:
        return []
    if not isinstance(ref, str) or resolve_local_ref(root, ref) is None:
        return [("$ref", f"cannot resolve {ref!r} (only '#' and '#/json/pointer' refs)")]
    if not is_legacy_draft(root) and _siblings(node, "$ref"):
        return [("$ref", f"keywords next to $ref are ignored: {_siblings(node, '$ref')}")]
    return []


def _enum_issues(node: dict, validator: Any) -> Issues:
    """enum/const win over every sibling: fine only if each value satisfies them."""
    kw = "const" if "const" in node else "enum" if "enum" in node else None
    if kw is None or not _siblings(node, "enum", "const"):
        return []
    values = [node["const"]] if kw == "const" else list(node["enum"])
    rest = {k: v for k, v in node.items() if k not in ("enum", "const")}
    sub = validator.evolve(schema=rest)
    bad = [v for v in values if not sub.is_valid(v)]
    if bad:
        return [(kw, f"value {json.dumps(bad[0])} violates sibling keywords, which are ignored")]
    return []


def _required_issues(node: dict) -> Issues:
    req = node.get("required")
    if not isinstance(req, list):
        return []
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    missing = [r for r in req if r not in props]
    if missing:
        return [("required", f"required property {missing[0]!r} is not declared in 'properties'")]
    return []


# --- oneOf disjointness -------------------------------------------------------------

def _vkey(v: Any) -> tuple:
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, (int, float)):
        return ("n", float(v))
    return ("j", json.dumps(v, sort_keys=True))


def _value_type(v: Any) -> set[str]:
    if isinstance(v, bool):
        return {"boolean"}
    if isinstance(v, (int, float)):
        return {"number", "integer"} if float(v).is_integer() else {"number"}
    return {{str: "string", list: "array", dict: "object", type(None): "null"}[type(v)]}


def _facts(branch: Any, root: Any, infer: bool) -> tuple[set | None, list | None, dict]:
    """(types, values, {required property: value keys}) over-approximating what one
    branch admits. `infer`: count xgrammar's inferred types (what it generates);
    without it only an explicit `type` restricts (what jsonschema admits)."""
    for _ in range(16):      # follow a short $ref chain
        if isinstance(branch, dict) and isinstance(branch.get("$ref"), str):
            target = resolve_local_ref(root, branch["$ref"])
            if target is None:
                break
            branch = target[0]
    if not isinstance(branch, dict):
        return None, None, {}
    values = None
    if "const" in branch:
        values = [branch["const"]]
    elif isinstance(branch.get("enum"), list):
        values = branch["enum"]
    if infer:
        types = _types(branch)
    else:
        types = _types({"type": branch["type"]}) if "type" in branch else None
    if types is not None and "number" in types:
        types = types | {"integer"}
    disc = {}
    props = branch.get("properties") if isinstance(branch.get("properties"), dict) else {}
    for name in branch.get("required", []) if isinstance(branch.get("required"), list) else []:
        p = props.get(name)
        if isinstance(p, dict) and ("const" in p or isinstance(p.get("enum"), list)):
            disc[name] = {_vkey(v) for v in ([p["const"]] if "const" in p else p["enum"])}
    return types, (None if values is None else values), disc


def _disjoint(a: tuple, b: tuple) -> bool:
    (ta, va, da), (tb, vb, db) = a, b
    if va is not None and vb is not None:
        return not ({_vkey(v) for v in va} & {_vkey(v) for v in vb})
    if va is not None and tb is not None:
        return all(not (_value_type(v) & tb) for v in va)
    if vb is not None and ta is not None:
        return all(not (_value_type(v) & ta) for v in vb)
    if ta is not None and tb is not None and not (ta & tb):
        return True
    if ta == {"object"} and tb == {"object"}:
        return any(not (da[k] & db[k]) for k in da.keys() & db.keys())
    return False


def _branches_imply_type(node: dict, kw: str, root: Any) -> bool:
    """Every branch of node[kw] admits only types that node["type"] allows."""
    allowed = _types({"type": node["type"]})
    branches = node[kw]
    if allowed is None or not isinstance(branches, list):
        return False
    if "number" in allowed:
        allowed = allowed | {"integer"}
    for types, values, _ in (_facts(b, root, infer=True) for b in branches):
        if values is not None:
            if any(not (_value_type(v) & allowed) for v in values):
                return False
        elif types is None or not types <= allowed:
            return False
    return True


def _pairwise_disjoint(branches: Any, root: Any) -> bool:
    if not isinstance(branches, list):
        return False
    facts = [_facts(b, root, infer=False) for b in branches]
    return all(_disjoint(facts[i], facts[j])
               for i in range(len(facts)) for j in range(i + 1, len(facts)))


# --- backend-specific -----------------------------------------------------------------

def xgrammar_only_issues(sn: SchemaNode, root: Any, validator: Any) -> Issues:
    node, out = sn.schema, []
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        out.append(("allOf", "allOf with more than one branch is not enforced"))
    out += _length_next_to_pattern(node)
    if "multipleOf" in node:
        bounded = any(k in node for k in NUMERIC if k != "multipleOf")
        m = node["multipleOf"]
        if node.get("type") != "integer" or bounded or not float(m).is_integer():
            out.append(("multipleOf", "only enforced on an integer type without bounds"))
    pp = node.get("patternProperties")
    if isinstance(pp, dict) and pp:
        out += _pattern_properties_issues(node, pp)
    if "propertyNames" in node and node.get("properties"):
        out.append(("propertyNames", "not enforced next to 'properties'"))
    for kw in ("exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(node.get(kw), bool):
            out.append((kw, "draft-04 boolean form"))
    return out


def _length_next_to_pattern(node: dict) -> Issues:
    if "pattern" not in node and "format" not in node:
        return []
    other = "pattern" if "pattern" in node else "format"
    return [(k, f"not enforced together with '{other}'")
            for k in ("minLength", "maxLength") if k in node]


def _pattern_properties_issues(node: dict, pp: dict) -> Issues:
    if len(pp) > 1:
        return [("patternProperties", "more than one pattern (a key may match several)")]
    pattern = next(iter(pp))
    try:
        rx = re.compile(pattern)
    except re.error:
        return [("patternProperties", f"pattern {pattern!r} is not a Python-compatible regex")]
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    clash = [p for p in props if rx.search(p)]
    if clash:
        return [("patternProperties", f"property {clash[0]!r} also matches {pattern!r}")]
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
    if isinstance(node.get("pattern"), str) and not pattern_is_json_safe(node["pattern"]):
        out.append(("pattern", "may match a quote, backslash or control character"))
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in OUTLINES_FORMATS:
        out.append(("format", f"format {fmt!r} is not supported"))
    if node.get("items") is False:
        out.append(("items", "`items: false` is not supported"))
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    if len([p for p in props if p not in required]) > OUTLINES_MAX_OPTIONAL:
        out.append(("properties", f"more than {OUTLINES_MAX_OPTIONAL} optional properties "
                                  "(outlines-core's regex for them explodes)"))
    return out

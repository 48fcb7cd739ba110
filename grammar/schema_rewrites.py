"""Exact one-node rewrites behind `schema_normalize`, each mapping a schema node
to one that admits exactly the same instances (or the node itself):
- `filter_enum`: the node means "one of the values and the siblings": the
  values that pass the siblings (checked by jsonschema) replace both; none
  left: `false`, which `forbid_property` turns into "the property is absent";
- `drop_inapplicable` / `complete_array`: keywords of types `type` excludes
  are dropped; a bounded array without `items` gets `items: {}`;
- `drop_vacuous_unique`: uniqueItems false, or next to maxItems <= 1, dropped;
- `property_names_as_patterns`: `propertyNames: {pattern: P}` on a node without
  `properties`/`patternProperties` becomes `patternProperties: {P: <what
  additionalProperties said>}` + `additionalProperties: false`;
- `declare_required`: a required name missing from `properties` is declared
  with the schema `additionalProperties` gives it;
- `fold_pattern_lengths`: minLength/maxLength folded into a counting pattern;
- `split_typeless`: type-specific keywords of one type on a node without
  `type` become `anyOf: [{type: T, ...}, {type: <every other type>}]`;
- `expand_dependencies`: dependencies/dependentRequired/dependentSchemas become
  an anyOf over "name absent" (`forbid_property`) / "name present and its
  dependency holds", for at most `MAX_DEPENDENCY_BRANCHES` cases.
Inputs are not mutated.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from formwork.grammar.schema_lengths import MAX_FOLDED_COUNT, fold_lengths, plain_length_pattern
from formwork.grammar.schema_oneof import ALL_TYPES, emitted_forms, inferred_types
from formwork.grammar.schema_rules import ARRAY, ASSERTIONS, NUMERIC, OBJECT, STRING

MAX_DEPENDENCY_BRANCHES = 8
DEPENDENCY_KEYWORDS = ("dependencies", "dependentRequired", "dependentSchemas")
_APPLIES_TO = {"string": STRING, "number": NUMERIC,
               "array": ARRAY + ("items", "prefixItems", "additionalItems"),
               "object": OBJECT + ("properties", "additionalProperties")}
_TYPE_GROUPS = (("string", STRING), ("number", NUMERIC), ("array", ARRAY), ("object", OBJECT))
Merge = Callable[[Any, Any], Any]


def filter_enum(node: dict, validator: Any) -> dict | bool:
    """`validator`: a jsonschema validator over the root (resolves local refs)."""
    if ("const" in node) == isinstance(node.get("enum"), list):
        return node                        # neither, or both
    if node.get("enum") == []:
        return False                       # no value (an empty intersection of enums)
    rest = {k: v for k, v in node.items() if k not in ("enum", "const")}
    if not any(k in ASSERTIONS for k in rest):
        return node
    values = [node["const"]] if "const" in node else node["enum"]
    try:
        sub = validator.evolve(schema=rest)
        keep = [v for v in values if all(sub.is_valid(x) for x in emitted_forms(v))]
    except Exception:                      # unresolvable ref, bad regex: leave it
        return node
    if not keep:
        return False
    return {k: v for k, v in node.items() if k not in ASSERTIONS} | {"enum": keep}


def drop_implied_lengths(node: dict, format_lengths: dict) -> dict:
    """`format_lengths`: {format: (shortest, longest or None)} a backend's format
    grammar generates. Without a pattern, lengths those imply are dropped."""
    implied = format_lengths.get(node.get("format")) if "pattern" not in node else None
    if implied is None:
        return node
    lo, hi = implied
    drop = {k for k in ("minLength", "maxLength") if k in node and _length(node[k]) is not None
            and (node[k] <= lo if k == "minLength" else hi is not None and node[k] >= hi)}
    return {k: v for k, v in node.items() if k not in drop} if drop else node


def lengths_as_plain_pattern(node: dict) -> dict:
    """xgrammar compiles a length-bounded string to a class that admits raw control
    characters (not JSON). `{"type": "string", "minLength": m, "maxLength": n}`
    without pattern/format becomes the pattern `^[plain]{m,n}$`, which it enforces
    exactly (stricter only in that quotes, backslashes and controls are never
    written, as in xgrammar's own length grammar). Counts above MAX_FOLDED_COUNT
    stay lengths (schema_rules flags them)."""
    if node.get("type") != "string" or "pattern" in node or "format" in node:
        return node
    lo, hi = _length(node.get("minLength")), _length(node.get("maxLength"))
    if (lo is None and hi is None) or max(lo or 0, hi or 0) > MAX_FOLDED_COUNT:
        return node
    rest = {k: v for k, v in node.items() if k not in ("minLength", "maxLength")}
    return rest | {"pattern": plain_length_pattern(lo or 0, hi)}


def drop_vacuous_unique(node: dict) -> dict:
    """`uniqueItems` that cannot fail (false, or at most one item) says nothing."""
    unique, most = node.get("uniqueItems"), node.get("maxItems")
    if unique is False or (unique is True and isinstance(most, (int, float))
                           and not isinstance(most, bool) and most <= 1):
        return {k: v for k, v in node.items() if k != "uniqueItems"}
    return node


_NOTES = frozenset({"title", "description", "$comment", "examples"})


def property_names_as_patterns(node: dict) -> dict:
    """Names must match P and every value meets `additionalProperties` (there are no
    declared or patterned names): exactly `patternProperties: {P: that}` with
    nothing else allowed; both keywords search their regex unanchored, and both
    apply to objects only."""
    names = node.get("propertyNames")
    if names is None or "unevaluatedProperties" in node:
        return node
    rest = {k: v for k, v in node.items() if k != "propertyNames"}
    if isinstance(names, dict) and names.get("type") == "string":   # names are strings
        names = {k: v for k, v in names.items() if k != "type"}
    if (not isinstance(names, dict) or set(names) - _NOTES != {"pattern"}
            or not isinstance(names["pattern"], str) or "properties" in node
            or "patternProperties" in node):
        return node
    rest.pop("additionalProperties", None)
    return rest | {"patternProperties": {names["pattern"]: node.get("additionalProperties", True)},
                   "additionalProperties": False}


def drop_inapplicable(node: dict) -> dict:
    """Keywords of types an explicit `type` excludes constrain nothing; xgrammar
    may still act on them (`items` next to `type: object` closes the object)."""
    t = node.get("type")
    types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None
    if types is None:
        return node
    types |= {"number"} if "integer" in types else set()
    drop = {k for name, group in _APPLIES_TO.items() if name not in types for k in group}
    return {k: v for k, v in node.items() if k not in drop} if drop & node.keys() else node


def complete_array(node: dict) -> dict:
    """`items: {}` (vacuous) on a bounded array without items: xgrammar's strict
    mode otherwise admits no items at all."""
    t = node.get("type")
    if (t == "array" or (isinstance(t, list) and "array" in t)) and \
            {"minItems", "maxItems"} & node.keys() and not {"items", "prefixItems"} & node.keys():
        return node | {"items": {}}
    return node


def declare_required(node: dict) -> dict:
    req, props = node.get("required"), node.get("properties", {})
    types = inferred_types(node)
    if not isinstance(req, list) or not isinstance(props, dict) or types is None \
            or "object" not in types:
        return node
    missing = [r for r in req if isinstance(r, str) and r not in props]
    extra = node.get("additionalProperties", True)
    if not missing or extra is False or \
            {"patternProperties", "unevaluatedProperties", "propertyNames"} & node.keys():
        return node
    return dict(node, properties=props | {r: ({} if extra is True else extra) for r in missing})


def _length(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if float(value).is_integer() and value >= 0 else None


def fold_pattern_lengths(node: dict) -> dict:
    pattern = node.get("pattern")
    if not isinstance(pattern, str) or not {"minLength", "maxLength"} & node.keys():
        return node
    lo, hi = _length(node.get("minLength", 0)), _length(node.get("maxLength", 0))
    if lo is None or hi is None:
        return node
    folded = fold_lengths(pattern, lo, hi if "maxLength" in node else None)
    if folded is None:
        return node
    try:
        re.compile(folded)
    except re.error:
        return node
    out = {k: v for k, v in node.items() if k not in ("minLength", "maxLength")}
    return out | {"pattern": folded}


def split_typeless(node: dict, stay: frozenset[str]) -> dict:
    """`stay`: keys (annotations, definitions) kept on the outer node."""
    keys = [k for k in node if k in ASSERTIONS]
    if not keys or inferred_types(node) is not None:
        return node
    for name, group in _TYPE_GROUPS:
        if all(k in group for k in keys):
            inner = {k: v for k, v in node.items() if k not in stay} | {"type": name}
            others = sorted(ALL_TYPES - {name, "integer"})
            outer = {k: v for k, v in node.items() if k in stay}
            inner = complete_array(declare_required(inner))
            return outer | {"anyOf": [inner, {"type": others}]}
    return node


def _dependency_cases(node: dict) -> dict[str, list] | None:
    """{name: [("required", [names]) | ("schema", schema)]}, or None if unsupported.
    Every draft's spelling is taken, also where the schema's draft does not define
    it (`dependencies` in 2020-12): enforcing a keyword the draft ignores only
    narrows the language, and is what the author meant."""
    cases: dict[str, list] = {}
    for kw in DEPENDENCY_KEYWORDS:
        if kw not in node:
            continue
        if not isinstance(node[kw], dict):
            return None
        for name, dep in node[kw].items():
            if isinstance(dep, list) and kw != "dependentSchemas":
                if not all(isinstance(x, str) for x in dep):
                    return None
                cases.setdefault(name, []).append(("required", dep))
            elif isinstance(dep, (dict, bool)) and kw != "dependentRequired":
                cases.setdefault(name, []).append(("schema", dep))
            else:
                return None
    return cases


def forbid_property(node: dict, name: str) -> dict | None:
    """`node` and "no property `name`", or None when that needs `false` (which
    xgrammar refuses). Without additionalProperties the result closes the object:
    stricter than `node` only on undeclared names, which xgrammar's strict mode
    never generates anyway."""
    props = node.get("properties", {})
    extra = node.get("additionalProperties", False)
    if extra is not False or name in node.get("required", []) or not isinstance(props, dict) or \
            {"patternProperties", "unevaluatedProperties"} & node.keys():
        return None
    props = {k: v for k, v in props.items() if k != name}
    return dict(node, properties=props, additionalProperties=False)


def forbid_property_exactly(node: dict, name: str) -> dict | None:
    """`node` and "no property `name`" as `properties: {name: false}`, for a backend
    that enforces `false` (llguidance): exact whatever the object says about other
    names. None when the node requires `name`."""
    props = node.get("properties", {})
    if name in node.get("required", []) or not isinstance(props, dict):
        return None
    return dict(node, properties=props | {name: False})


Forbid = Callable[[dict, str], "dict | None"]


def _present(node: dict, name: str, deps: list, merge: Merge) -> dict | None:
    out: Any = dict(node, required=list(dict.fromkeys(node.get("required", []) + [name])))
    for kind, dep in deps:
        if kind == "required":
            out["required"] = list(dict.fromkeys(out["required"] + dep))
        else:
            out = merge(out, dep)
            if not isinstance(out, dict):
                return None
    return out


def expand_dependencies(node: dict, merge: Merge, stay: frozenset[str],
                        forbid: Forbid = forbid_property) -> dict:
    """`merge(a, b)`: one schema meaning "a and b", or None; `forbid(node, name)`:
    `node` without property `name`, or None."""
    cases = _dependency_cases(node)
    if not cases:
        return node
    base = {k: v for k, v in node.items() if k not in DEPENDENCY_KEYWORDS and k not in stay}
    if {"anyOf", "oneOf", "allOf", "$ref", "not", "if"} & base.keys() or \
            not isinstance(base.get("properties", {}), dict) or \
            not isinstance(base.get("required", []), list) or \
            "object" not in (inferred_types(base) or ()):
        return node
    branches = [base]
    for name, deps in cases.items():
        grown = []
        for b in branches:
            if name not in b.get("required", []):
                absent = forbid(b, name)
                if absent is None:
                    return node
                grown.append(absent)
            present = _present(b, name, deps, merge)
            if present is None:
                return node
            grown.append(present)
        branches = grown
        if len(branches) > MAX_DEPENDENCY_BRANCHES:
            return node
    branches = [declare_required(b) for b in branches]
    outer = {k: v for k, v in node.items() if k in stay}
    return branches[0] | outer if len(branches) == 1 else outer | {"anyOf": branches}

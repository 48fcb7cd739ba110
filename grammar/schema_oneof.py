"""Proofs that the branches of a oneOf are mutually exclusive.

xgrammar generates `oneOf` as `anyOf`. That is exact when no instance it can
generate for one branch is also valid against another: `excludes(g, v)` proves
"gen(g) and valid(v) share no instance", where gen(g) is what xgrammar emits
for g (inside valid(g): every other keyword of an accepted schema is enforced
exactly or more strictly, and xgrammar infers `object` from `properties` and
`array` from `items`) and valid(v) is what jsonschema admits. A proof may fail
on branches that are disjoint; it never succeeds on branches that overlap.

Proofs, applied recursively (bounded depth and steps):
- enum/const on either side: jsonschema validates each value against the other;
- JSON types that cannot meet;
- anyOf/oneOf/allOf/`$ref` on either side, by their branches or target;
- objects: a property required on one side whose value schemas exclude each
  other (discriminated unions), or that the other side forbids;
- strings: anchored patterns whose fixed-character prefixes differ somewhere;
- arrays, one side with minItems >= 1: items that exclude each other;
- objects both closed to disjoint property sets, one side with minProperties >= 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from formwork.grammar.pattern_prefix import patterns_disjoint
from formwork.grammar.schema_walk import resolve_local_ref

ALL_TYPES = frozenset({"null", "boolean", "object", "array", "number", "integer", "string"})
_MAX_DEPTH = 8
_MAX_STEPS = 4000          # per oneOf node


def inferred_types(node: dict) -> set[str] | None:
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


def value_types(v: Any) -> set[str]:
    if isinstance(v, bool):
        return {"boolean"}
    if isinstance(v, int):
        return {"number", "integer"}
    if isinstance(v, float):
        return {"number", "integer"} if v.is_integer() else {"number"}
    return {{str: "string", list: "array", dict: "object", type(None): "null"}[type(v)]}


def emitted_forms(v: Any) -> list:
    """`v` and what xgrammar's output for it may parse back as (it writes an
    integral float such as 1.0 as `1`, which jsonschema's draft 4 calls an
    integer where it calls 1.0 a number)."""
    if isinstance(v, float) and v.is_integer():
        return [v, int(v)]
    return [v]


def _equal_forms(v: Any) -> list:
    """`v` and the other instance jsonschema's enum/const call equal to it."""
    if isinstance(v, float) and v.is_integer():
        return [v, int(v)]
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2 ** 53:
        return [v, float(v)]
    return [v]


def _widen(types: set[str]) -> set[str]:
    return types | {"integer"} if "number" in types else types


def _values(node: dict) -> list | None:
    if "const" in node:
        return [node["const"]]
    return node["enum"] if isinstance(node.get("enum"), list) else None


@dataclass(slots=True)
class _Proof:
    root: Any
    validator: Any     # jsonschema validator over `root` (resolves its local refs)
    steps: int = _MAX_STEPS
    gen_root: Any = None   # the document the generated side `g` lives in (default: root)

    def deref(self, node: Any, root: Any = None) -> Any:
        """`node` with a chain of local `$ref`s followed in `root` (default: the
        schema's); True/False/dict, or None if a ref does not resolve. gen(node) and
        valid(node) lie inside the target's."""
        root = self.root if root is None else root
        for _ in range(16):
            if node is True:
                return {}
            if not isinstance(node, dict) or not isinstance(node.get("$ref"), str):
                return node if isinstance(node, (dict, bool)) else None
            target = resolve_local_ref(root, node["$ref"])
            if target is None:
                return None
            node = target[0]
        return None

    def is_valid(self, value: Any, schema: Any) -> bool:
        try:
            return self.validator.evolve(schema=schema).is_valid(value)
        except Exception:          # unresolvable ref, odd regex: assume it may match
            return True

    def gen_types(self, g: dict, depth: int) -> set[str] | None:
        values = _values(g)
        if values is not None:
            return set().union(*(value_types(v) for v in values)) if values else set()
        own = inferred_types(g)
        if own is not None:
            return _widen(own)
        self.steps -= 1
        for kw in ("anyOf", "oneOf"):
            if isinstance(g.get(kw), list) and depth < _MAX_DEPTH and self.steps > 0:
                out: set[str] = set()
                for b in g[kw]:
                    b = self.deref(b, self.gen_root)
                    t = set() if b is False else None if b is None else self.gen_types(b, depth + 1)
                    if t is None:
                        return None
                    out |= t
                return out
        return None

    def valid_values(self, v: dict) -> list | None:
        """`_values` as the validator reads `v`: drafts 3 and 4 have no `const` (a
        draft-04 schema's `const: false` is an annotation, so `oneOf: [{const: false},
        {type: null}]` fails null, which both branches pass; xgrammar wrote it)."""
        if "const" in v and self.validator is not None and \
                "const" not in getattr(self.validator, "VALIDATORS", {"const": None}):
            return v["enum"] if isinstance(v.get("enum"), list) else None
        return _values(v)

    def valid_types(self, v: dict) -> set[str] | None:
        values = self.valid_values(v)
        if values is not None:
            return set().union(*(value_types(x) for x in values)) if values else set()
        t = v.get("type")
        return _widen({t} if isinstance(t, str) else set(t)) if isinstance(t, (str, list)) \
            else None

    def excludes(self, g: Any, v: Any, depth: int = 0) -> bool:
        """True only if no instance xgrammar generates for `g` is valid against `v`."""
        g, v = self.deref(g, self.gen_root), self.deref(v)
        if g is False or v is False:
            return True
        if g is None or v is None or depth > _MAX_DEPTH or self.steps <= 0:
            return False
        self.steps -= 1
        gv, vv = _values(g), self.valid_values(v)
        if gv is not None:
            return not any(self.is_valid(y, v) for x in gv for y in emitted_forms(x))
        if vv is not None and not any(self.is_valid(y, g) for x in vv for y in _equal_forms(x)):
            return True          # gen(g) lies inside valid(g)
        tg, tv = self.gen_types(g, depth), self.valid_types(v)
        if tg is not None and tv is not None and not tg & tv:
            return True
        return self._by_branches(g, v, depth) or \
            (tg is not None and tg <= {"object"} and (self._by_property(g, v, depth) or
                                                     _closed_apart(g, v))) or \
            (tg is not None and tg <= {"array"} and self._by_items(g, v, depth)) or \
            (tg is not None and tg <= {"string"} and _patterns_exclude(g, v))

    def _by_items(self, g: dict, v: dict, depth: int) -> bool:
        """gen(g) holds arrays only. When one side admits no empty array, a shared
        instance has a first item, which would lie in gen(g.items) and valid(v.items)."""
        if not (_at_least_one(g, "minItems") or _at_least_one(v, "minItems")):
            return False
        if any("prefixItems" in n or not isinstance(n.get("items"), (dict, bool))
               for n in (g, v)):
            return False
        return self.excludes(g["items"], v["items"], depth + 1)

    def _by_branches(self, g: dict, v: dict, depth: int) -> bool:
        for kw in ("anyOf", "oneOf"):
            if isinstance(g.get(kw), list) and \
                    all(self.excludes(b, v, depth + 1) for b in g[kw]):
                return True
            if isinstance(v.get(kw), list) and \
                    all(self.excludes(g, b, depth + 1) for b in v[kw]):
                return True
        if isinstance(g.get("allOf"), list) and len(g["allOf"]) == 1 and \
                self.excludes(g["allOf"][0], v, depth + 1):
            return True
        return isinstance(v.get("allOf"), list) and \
            any(self.excludes(g, b, depth + 1) for b in v["allOf"])

    def _by_property(self, g: dict, v: dict, depth: int) -> bool:
        """gen(g) holds objects only. A key that one side requires and whose value
        schemas exclude each other (or that the other side forbids) separates them."""
        keys = []
        for node in (g, v):
            req = node.get("required")
            keys += [k for k in req if isinstance(k, str)] if isinstance(req, list) else []
        for key in dict.fromkeys(keys):
            gm, vm = _member(g, key), _member(v, key)
            if gm is not None and vm is not None and self.excludes(gm, vm, depth + 1):
                return True
        return False


def _at_least_one(node: dict, bound: str) -> bool:
    value = node.get(bound)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 1


def _closed_apart(g: dict, v: dict) -> bool:
    """Both objects closed (additionalProperties false) to property sets with no
    common name: only `{}` could be in both, and one side refuses it."""
    for node in (g, v):
        if node.get("additionalProperties") is not False or not isinstance(
                node.get("properties", {}), dict) or \
                {"patternProperties", "unevaluatedProperties"} & node.keys():
            return False
    if set(g.get("properties", {})) & set(v.get("properties", {})):
        return False
    return _at_least_one(g, "minProperties") or _at_least_one(v, "minProperties")


def _member(node: dict, key: str) -> Any:
    """The schema a value under `key` of a valid object must meet (True when
    unconstrained, False when `key` is forbidden), or None if unknown."""
    props = node.get("properties")
    if isinstance(props, dict) and key in props:
        return props[key]
    if node.get("patternProperties") or "unevaluatedProperties" in node:
        return None
    return node.get("additionalProperties", True)


def _patterns_exclude(g: dict, v: dict) -> bool:
    return patterns_disjoint(g.get("pattern"), v.get("pattern"))


def pairwise_disjoint(branches: Any, root: Any, validator: Any,
                      generated: Any = None, gen_root: Any = None) -> bool:
    """Every two branches of a oneOf provably exclude each other, both ways.

    `generated` (with `gen_root`, the document it lives in): the same branches as
    the backend generates them, e.g. with objects closed to their declared names;
    then what each generates is judged against the others as written, which proves
    more (`oneOf: [{required: [a]}, {required: [b]}]` overlaps as written, yet a
    first branch closed to `a` never writes `b`)."""
    if not isinstance(branches, list):
        return False
    if not (isinstance(generated, list) and len(generated) == len(branches)):
        generated, gen_root = branches, None
    proof = _Proof(root, validator, gen_root=gen_root)
    return all(proof.excludes(generated[i], branches[j]) and proof.excludes(generated[j], branches[i])
               for i in range(len(branches)) for j in range(i + 1, len(branches)))


def branches_imply_type(node: dict, kw: str, root: Any) -> bool:
    """Every branch of node[kw] generates only types that node["type"] allows."""
    allowed = inferred_types({"type": node["type"]})
    branches = node[kw]
    if allowed is None or not isinstance(branches, list):
        return False
    allowed = _widen(allowed)
    proof = _Proof(root, None)
    for b in branches:
        b = proof.deref(b)
        if b is False:
            continue
        if b is None:
            return False
        values = _values(b)
        if values is not None:
            if any(not (value_types(v) & allowed) for v in values):
                return False
            continue
        types = proof.gen_types(b, 0)
        if types is None or not types <= allowed:
            return False
    return True

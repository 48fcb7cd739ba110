"""if/then/else on a discriminator property with finitely many values, as an anyOf.

No backend enforces if/then/else. A common shape conditions on one property:
`{properties: {kind: {enum: [a, b, c]}}, allOf: [{if: {properties: {kind:
{const: a}}, required: [kind]}, then: A}, ...]}`. When every condition is
`{properties: {k: S}}` (with `required: [k]` or not) on the same `k`, and the
node itself lists k's values (enum/const), the node is split by the value of k:
one branch per value e (k = e, with the `then` of every condition e meets and the
`else` of every other), plus, when k is optional, one where k is absent (a
condition without `required` holds there). The cases are exhaustive and
exclusive, so the anyOf means exactly the node on objects (each branch is built
with `merge`, exact or None); non-objects are refused (stricter: they met the
node only through conditions that are vacuous for them). Anything else is left
alone (and stays flagged).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from formwork.grammar.schema_oneof import inferred_types
from formwork.grammar.schema_rewrites import Forbid, forbid_property

MAX_IF_BRANCHES = 16
_IF = frozenset({"if", "then", "else"})
Cond = tuple[Any, Any, Any]          # (if, then, else)


def _conditions(node: dict, annotations: frozenset[str]) -> tuple[list, list[Cond]]:
    """(allOf branches that are not a bare if/then/else, the conditions)."""
    conds: list[Cond] = []
    if "if" in node:
        conds.append((node["if"], node.get("then"), node.get("else")))
    others = []
    for b in node.get("allOf", []) if isinstance(node.get("allOf"), list) else []:
        if isinstance(b, dict) and "if" in b and set(b) - annotations <= _IF:
            conds.append((b["if"], b.get("then"), b.get("else")))
        else:
            others.append(b)
    return others, conds


def _discriminator(cond: Any, annotations: frozenset[str]) -> tuple[str, Any, bool] | None:
    """(k, S, k required) for `{properties: {k: S}, required: [k]?}`, else None."""
    if not isinstance(cond, dict) or cond.get("type", "object") != "object":
        return None
    props, req = cond.get("properties"), cond.get("required", [])
    if set(cond) - annotations - {"type"} - {"properties", "required"} or \
            not isinstance(props, dict) or len(props) != 1 or not isinstance(req, list):
        return None
    (k, s), = props.items()
    return (k, s, bool(req)) if set(req) <= {k} else None


def expand_if_then(node: dict, merge: Callable[[Any, Any], Any], resolve: Callable[[Any], Any],
                   validator: Any, stay: frozenset[str],
                   forbid: Forbid = forbid_property) -> dict | None:
    """`merge(a, b)`: one schema meaning both, or None; `resolve`: a `$ref`-only
    schema's target; `validator`: jsonschema's over the root; `forbid(node, name)`:
    `node` without property `name`, or None. None if not handled."""
    others, conds = _conditions(node, stay)
    parsed = [_discriminator(c[0], stay) for c in conds]
    if not conds or None in parsed or len({p[0] for p in parsed}) != 1:  # type: ignore[index]
        return None
    k = parsed[0][0]                                                      # type: ignore[index]
    base: Any = {key: v for key, v in node.items() if key not in _IF | {"allOf"} | stay}
    for b in others:
        base = merge(base, resolve(b)) if base is not None else None
    if not isinstance(base, dict) or inferred_types(base) != {"object"} or \
            not isinstance(base.get("properties"), dict) or k not in base["properties"]:
        return None
    base = base | {"type": "object"}   # stated: a backend may not infer it from `properties`
    member = resolve(base["properties"][k])
    domain = _domain(member, validator)
    if domain is None or len(domain) + 1 > MAX_IF_BRANCHES:
        return None
    base = base | {"properties": base["properties"] | {k: member}}
    try:
        cases = [(merge(base, {"properties": {k: {"const": e}}, "required": [k]}),
                  [validator.evolve(schema=p[1]).is_valid(e) for p in parsed])   # type: ignore[index]
                 for e in domain]
    except Exception:                      # unresolvable ref, odd regex: leave it
        return None
    if k not in base.get("required", []):
        cases.append((forbid(base, k), [not p[2] for p in parsed]))   # type: ignore[index]
    branches = []
    for start, holds in cases:
        branch = _apply(start, [c[1] if h else c[2] for c, h in zip(conds, holds)], merge, resolve)
        if branch is None:
            return None
        if branch is not False:
            branches.append(branch)
    outer = {key: v for key, v in node.items() if key in stay}
    return outer | ({"anyOf": branches} if branches else {"not": {}})


def _domain(member: Any, validator: Any) -> list | None:
    """The values a property schema lists (and admits), or None."""
    if not isinstance(member, dict):
        return None
    values = [member["const"]] if "const" in member else member.get("enum")
    if not isinstance(values, list):
        return None
    try:
        return [v for v in values if validator.evolve(schema=member).is_valid(v)]
    except Exception:
        return None


def _apply(branch: Any, parts: list, merge: Callable[[Any, Any], Any],
           resolve: Callable[[Any], Any]) -> Any:
    """`branch` and every part (None/true: nothing; false: the branch is empty,
    returned as False); None when a merge fails."""
    for part in parts:
        if branch is None:
            return None
        part = resolve(part)
        if part is None or part is True:
            continue
        if part is False:
            return False
        branch = merge(branch, part)
    return branch

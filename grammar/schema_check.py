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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

from formwork.grammar.schema_rewrites import drop_implied_lengths
from formwork.grammar.schema_rules import (
    XGRAMMAR_FORMAT_LENGTHS,
    common_issues,
    ref_issues,
    outlines_only_issues,
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


def check_metaschema(schema: Any) -> None:
    """Raise ValueError unless `schema` is valid against its draft's meta-schema."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError("invalid JSON Schema at $: a schema must be an object or a boolean")
    cls = validator_class(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as err:
        path = "$"
        for key in err.absolute_path:
            path = child_path(path, key)
        raise ValueError(f"invalid JSON Schema at {path}: {err.message}") from None


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
            issues += [SchemaIssue(kw, node.path, detail)
                       for kw, detail in rule(node, schema, validator)]
    return issues


def check_schema(schema: Any, backend: str) -> Any:
    """Meta-schema check; return `schema`, or an equivalent rewrite of it
    (`schema_normalize`), that `backend` enforces exactly. Otherwise raise
    UnsupportedSchemaError listing what `backend` drops (paths into `schema`)."""
    check_metaschema(schema)
    issues = find_issues(schema, backend)
    if not issues:
        return _backend_view(schema, backend)
    rewritten = normalize(schema)
    if rewritten is not schema and not find_issues(rewritten, backend):
        return _backend_view(rewritten, backend)
    raise UnsupportedSchemaError(issues, backend)


def _backend_view(schema: Any, backend: str) -> Any:
    """xgrammar: lengths its format grammars imply are dropped (it would warn
    about them and ignore them; the format alone enforces them)."""
    if backend != "xgrammar":
        return schema
    return map_subschemas(schema, lambda node: drop_implied_lengths(node, XGRAMMAR_FORMAT_LENGTHS))

"""Structural tags (tool calls in `auto` mode) as xgrammar's format dict.

Two spellings are accepted:
- {"triggers": ["<tool_call>"], "structures": [{"begin", "schema", "end"}, ...]}:
  free text, and whenever a trigger starts, one of the structures (its
  `schema` constrains the JSON between `begin` and `end`);
  vLLM's shape, the same with "type": "structural_tag";
- xgrammar's own {"type": "structural_tag", "format": {...}}.
Every embedded JSON Schema is checked like a `json` constraint, and its
whitespace bounded like one.

formwork adds one content type, `{"type": "lark", "grammar": "..."}`: the tag's
content is a Lark grammar's language, served by llguidance only (xgrammar's
format language has no Lark); gateway/tools.py writes it for custom tools whose
input follows a Lark grammar, called between tool-call tags (tool_choice auto,
or required). A top-level `tags_with_separator` (at least one tag) is the calls
alone: AnswerOrCalls without an answer.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from formwork.grammar.schema_check import SchemaIssue, UnsupportedSchemaError
from formwork.schemas.structured import StructuredOutputsParams


def _max_ws(params: StructuredOutputsParams) -> int:
    # xgrammar needs a positive count here; "compact" gets the smallest bound.
    if params.whitespace == "compact":
        return 1
    return max(1, params.max_whitespace)


def _checked(schema: Any, where: str, check: Callable[[Any], Any]) -> Any:
    """The schema `check(schema)` returns (maybe rewritten); unsupported keywords
    re-raised with paths under `where`."""
    try:
        return check(schema)
    except UnsupportedSchemaError as err:
        issues = [SchemaIssue(i.keyword, where + i.path[1:], i.detail) for i in err.issues]
        raise UnsupportedSchemaError(issues, err.backend) from None
    except ValueError as err:
        raise ValueError(f"structural_tag {where}: {err}") from None


def _legacy_to_format(spec: dict, params: StructuredOutputsParams,
                      check: Callable[[Any], Any]) -> dict:
    triggers, structures = spec.get("triggers"), spec.get("structures")
    if not isinstance(triggers, list) or not triggers or not isinstance(structures, list):
        raise ValueError("structural_tag: needs non-empty 'triggers' and a 'structures' list")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not {"begin", "schema", "end"} <= s.keys():
            raise ValueError(f"structural_tag.structures[{i}]: needs 'begin', 'schema', 'end'")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise ValueError(f"structural_tag.structures[{i}]: 'begin' starts with no trigger")
        schema = _checked(s["schema"], f"$.structures[{i}].schema", check)
        tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                     "content": {"type": "json_schema", "json_schema": schema,
                                 "max_whitespace_cnt": _max_ws(params)}})
    return {"type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags,
                       "at_least_one": False, "stop_after_first": False}}


def _bound_json_formats(node: Any, path: str, params: StructuredOutputsParams,
                        check: Callable[[Any], Any]) -> None:
    """Check every json_schema format in place and bound its whitespace."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            node["json_schema"] = _checked(node["json_schema"], f"{path}.json_schema", check)
            node.setdefault("max_whitespace_cnt", _max_ws(params))
        for key, value in node.items():
            if key != "json_schema":
                _bound_json_formats(value, f"{path}.{key}", params, check)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _bound_json_formats(value, f"{path}[{i}]", params, check)


def _is_own_format(spec: dict) -> bool:
    """xgrammar's own spelling ({"type": "structural_tag", "format": ...}); vLLM's
    {"type": "structural_tag", "triggers", "structures"} is the legacy one."""
    return "format" in spec and "structures" not in spec


def structural_tag_spec(spec: Any, params: StructuredOutputsParams,
                        check: Callable[[Any], Any]) -> dict:
    """xgrammar's structural-tag dict for `spec` (not mutated), schemas checked."""
    if not isinstance(spec, dict):
        raise ValueError("structural_tag: must be an object")
    if _is_own_format(spec):
        tag = copy.deepcopy(spec)
        _bound_json_formats(tag, "$", params, check)
        return tag
    return _legacy_to_format(spec, params, check)


@dataclass(frozen=True, slots=True)
class LarkContent:
    """A tag's content that is a Lark grammar's language (in place of a schema)."""
    grammar: str


def _tag_content(content: Any) -> Any:
    """A tag's content as the neutral views hold it: its JSON schema, or LarkContent;
    None for anything else."""
    if not isinstance(content, dict):
        return None
    if content.get("type") == "json_schema":
        return content.get("json_schema")
    if content.get("type") == "lark" and isinstance(content.get("grammar"), str):
        return LarkContent(content["grammar"])
    return None


@dataclass(frozen=True, slots=True)
class TriggeredTags:
    """Free text; each trigger starts one of `tags` (begin, schema or LarkContent,
    end): the backend-neutral view of both spellings, for backends other than
    xgrammar."""
    triggers: tuple[str, ...]
    tags: tuple[tuple[str, Any, str], ...]
    at_least_one: bool = False
    stop_after_first: bool = False


def triggered_tags(spec: Any, params: StructuredOutputsParams,
                   check: Callable[[Any], Any]) -> TriggeredTags:
    """`spec` as TriggeredTags, schemas checked; ValueError for what only
    xgrammar's format language can say (nested formats, regex/grammar contents)."""
    tag = structural_tag_spec(spec, params, check)["format"]
    if tag.get("type") != "triggered_tags":
        raise ValueError(f"structural_tag: format type {tag.get('type')!r} is served by "
                         "backend 'xgrammar' only")
    tags = []
    for i, t in enumerate(tag.get("tags") or []):
        content = _tag_content(t.get("content") if isinstance(t, dict) else None)
        if content is None:
            raise ValueError(f"structural_tag: tags[{i}] content other than json_schema (or "
                             "lark) is served by backend 'xgrammar' only")
        tags.append((t["begin"], content, t.get("end", "")))
    triggers = tuple(tag.get("triggers") or ())
    if not tags or not triggers:
        raise ValueError("structural_tag: needs triggers and at least one tag")
    for begin, _, _ in tags:
        if not any(begin.startswith(tr) for tr in triggers):
            raise ValueError(f"structural_tag: begin {begin!r} starts with no trigger")
    return TriggeredTags(triggers, tuple(tags), bool(tag.get("at_least_one")),
                         bool(tag.get("stop_after_first")))


@dataclass(frozen=True, slots=True)
class AnswerOrCalls:
    """A JSON answer (None: none), or one or more tags (begin, schema or LarkContent,
    end) joined by `separator`
    and nothing else (`response_format` beside `tool_choice: "auto"`,
    gateway/tools.py `_answer_or_calls_tag`): the neutral view for llguidance."""
    answer: Any
    tags: tuple[tuple[str, Any, str], ...]
    separator: str
    stop_after_first: bool


def answer_or_calls(spec: Any, params: StructuredOutputsParams,
                    check: Callable[[Any], Any]) -> AnswerOrCalls | None:
    """`spec` as AnswerOrCalls (schemas checked), or None for any other shape; the
    calls alone (a top-level tags_with_separator, at least one) have answer None."""
    if not isinstance(spec, dict) or not _is_own_format(spec):
        return None
    fmt = spec.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "tags_with_separator":
        one = answer_or_calls(spec | {"format": {"type": "or", "elements": [
            {"type": "json_schema", "json_schema": {}}, fmt]}}, params, check)
        return None if one is None else AnswerOrCalls(None, one.tags, one.separator,
                                                      one.stop_after_first)
    if not isinstance(fmt, dict) or fmt.get("type") != "or":
        return None
    elements = fmt.get("elements") or []
    if len(elements) != 2 or not all(isinstance(e, dict) for e in elements):
        return None
    answer, calls = elements
    if answer.get("type") != "json_schema" or calls.get("type") != "tags_with_separator":
        return None
    tags = calls.get("tags") or []
    if not tags or not calls.get("at_least_one") or not all(
            isinstance(t, dict) and "begin" in t and _tag_content(t.get("content")) is not None
            for t in tags):
        return None
    answer, calls = structural_tag_spec(spec, params, check)["format"]["elements"]  # checked
    return AnswerOrCalls(
        answer["json_schema"],
        tuple((t["begin"], _tag_content(t["content"]), t.get("end", "")) for t in calls["tags"]),
        str(calls.get("separator", "")), bool(calls.get("stop_after_first")))

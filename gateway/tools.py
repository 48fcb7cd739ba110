"""Tool calling: which constraint a `tool_choice` needs, and parsing calls back out.

Calls use the Hermes format the tools prompt (gateway/chat.py) teaches:
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

tool_choice  | constraint on the output                     | parsed as
-------------|----------------------------------------------|------------------------
"none"       | none (tools are left out of the prompt)      | plain content
"auto"       | structural tag: free text; after the trigger | content + every closed
             | `<tool_call>` the call is forced to a known  | <tool_call> segment
             | name and arguments valid for its parameters; |
             | without parallel calls the output ends after |
             | the first call (xgrammar's stop_after_first) |
"required"   | JSON: one {"name", "arguments"} object (any  | the JSON value
             | tool), or an array of them if parallel       |
named        | JSON: that function's parameters schema      | arguments = the output
"auto" with  | structural tag: either the response_format's | content (the answer) or
response_    | JSON, or one or more <tool_call> segments    | the calls, as "auto"
format       | (only one without parallel calls)            |

With a `response_format`, "none" applies the format and "required"/named the
tool constraint (the format is for the final answer, as OpenAI's).

A tool's parameters schema keeps its meaning wherever it is embedded: in the
"required" wrapper its `$defs`/`definitions` move to the wrapper's root (renamed
per tool) and its local `$ref`s are rewritten to the new locations.

`parallel_tool_calls=false` is enforced by the grammar in auto and required
modes: at most one call can be generated, none is dropped afterwards.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from formwork.gateway.errors import bad_request
from formwork.gateway.schema_embed import defs_prefix, embed_schema
from formwork.schemas.openai import (ChatCompletionRequest, DeltaFunctionCall, DeltaToolCall,
                            FunctionCall, FunctionDefinition, NamedToolChoice, ToolCall, random_id)
from formwork.schemas.structured import StructuredOutputsParams

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
_EMPTY_PARAMS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolMode:
    kind: str                                # "none" | "auto" | "required" | "named"
    tools: tuple[FunctionDefinition, ...]
    name: str | None = None                  # set when kind == "named"
    parallel: bool = True

    @property
    def in_prompt(self) -> bool:
        return self.kind != "none" and bool(self.tools)


def resolve_tool_mode(req: ChatCompletionRequest) -> ToolMode:
    """Validate tools/tool_choice (400 naming `tool_choice`/`tools`) and pick the mode."""
    tools = tuple(t.function for t in req.tools or ())
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", param="tools")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(
                f"tool_choice: function {choice.function.name!r} is not among the tools "
                f"({', '.join(names) or 'none given'})", param="tool_choice")
        return ToolMode("named", tools, choice.function.name, req.parallel_tool_calls)
    if choice in ("required", "auto") and not tools and req.tool_choice is not None:
        raise bad_request(f"tool_choice: {choice!r} needs a non-empty 'tools' list",
                          param="tool_choice")
    return ToolMode(choice, tools, None, req.parallel_tool_calls)


def parameters_schema(fn: FunctionDefinition) -> dict:
    return fn.parameters if fn.parameters else dict(_EMPTY_PARAMS)


def _call_schema(name: str, arguments: dict) -> dict:
    return {"type": "object",
            "properties": {"name": {"const": name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def _required_schema(mode: ToolMode) -> dict:
    """One {"name", "arguments"} call of any tool (an array of them if parallel), each
    tool's definitions hoisted to the root so that its `$ref`s resolve there; a
    `$schema` all tools agree on becomes the wrapper's (draft-07 `$ref` rules stay)."""
    base = "/items/anyOf" if mode.parallel else "/anyOf"
    params = [parameters_schema(fn) for fn in mode.tools]
    dialects = {json.dumps(p.get("$schema")) for p in params if isinstance(p, dict)}
    dialect = json.loads(dialects.pop()) if len(dialects) == 1 else None
    if not isinstance(dialect, str) or re.search(r"draft-0[34]/", dialect):
        dialect = None             # no `const` before draft-06: left where it was
    if dialect is not None:
        params = [{k: v for k, v in p.items() if k != "$schema"} for p in params]
    branches, hoisted = [], {}
    for i, (fn, p) in enumerate(zip(mode.tools, params)):
        args = embed_schema(p, f"{base}/{i}/properties/arguments", defs_prefix(fn.name, i),
                            hoisted)
        branches.append(_call_schema(fn.name, args))
    one = {"anyOf": branches}
    schema = {"type": "array", "items": one, "minItems": 1} if mode.parallel else one
    if dialect is not None:
        schema = {"$schema": dialect} | schema
    return schema | hoisted


def tool_constraint(mode: ToolMode,
                    answer: StructuredOutputsParams | None = None) -> StructuredOutputsParams | None:
    """The output constraint of `mode`; None when the output is unconstrained.
    `answer` (the response_format's constraint) is the alternative to tool calls in
    "auto" mode, and applies alone in "none" mode."""
    if mode.kind == "named":
        fn = next(t for t in mode.tools if t.name == mode.name)
        return StructuredOutputsParams(json=parameters_schema(fn))
    if mode.kind == "required":
        return StructuredOutputsParams(json=_required_schema(mode))
    if mode.kind == "auto" and mode.tools:
        if answer is not None:
            return StructuredOutputsParams(structural_tag=_answer_or_calls_tag(mode, answer))
        return StructuredOutputsParams(structural_tag=_auto_tag(mode))
    return answer


def _call_tags(mode: ToolMode) -> list[dict]:
    return [{"type": "tag", "begin": f'{TOOL_CALL_OPEN}\n{{"name": "{t.name}", "arguments": ',
             "content": {"type": "json_schema", "json_schema": parameters_schema(t)},
             "end": f"}}\n{TOOL_CALL_CLOSE}"} for t in mode.tools]


def _auto_tag(mode: ToolMode) -> dict:
    """xgrammar structural tag: free text, each `<tool_call>` forced into a valid call;
    stop_after_first ends the output after one call when calls are not parallel."""
    return {"type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": [TOOL_CALL_OPEN],
                       "tags": _call_tags(mode), "at_least_one": False,
                       "stop_after_first": not mode.parallel}}


def _answer_or_calls_tag(mode: ToolMode, answer: StructuredOutputsParams) -> dict:
    """xgrammar structural tag: the answer's JSON, or one or more tool calls (one per
    line; only one without parallel calls) and nothing else."""
    schema = {"type": "object"} if answer.kind() == "json_object" else answer.spec()
    schema = {} if schema is True else schema
    calls = {"type": "tags_with_separator", "tags": _call_tags(mode), "separator": "\n",
             "at_least_one": True, "stop_after_first": not mode.parallel}
    return {"type": "structural_tag",
            "format": {"type": "or", "elements": [
                {"type": "json_schema", "json_schema": schema}, calls]}}


def tag_answer(tag: dict) -> dict | bool | None:
    """The answer's JSON schema inside an `_answer_or_calls_tag`; None for any other tag."""
    fmt = tag.get("format") if isinstance(tag, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") != "or":
        return None
    first = (fmt.get("elements") or [{}])[0]
    return first.get("json_schema") if first.get("type") == "json_schema" else None


def _compact(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _call_from_json(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(function=FunctionCall(name=obj["name"], arguments=_compact(args)))


def parse_tool_output(mode: ToolMode, text: str) -> tuple[str | None, list[ToolCall]]:
    """Split a finished output into (content, tool calls). Unparseable calls stay content."""
    if mode.kind == "named":
        try:
            args = _compact(json.loads(text))
        except json.JSONDecodeError:
            args = text  # cut by max_tokens: hand back what was generated
        return None, [ToolCall(function=FunctionCall(name=mode.name, arguments=args))]
    if mode.kind == "required":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call_from_json(_compact(i)) for i in items]
        if any(c is None for c in calls):
            return text, []
        return None, calls
    if mode.kind == "auto" and mode.tools:
        calls, content, last = [], [], 0
        for m in _CALL_RE.finditer(text):
            call = _call_from_json(m.group(1).strip())
            if call is None:
                continue
            content.append(text[last:m.start()])
            last = m.end()
            if mode.parallel or not calls:
                calls.append(call)
        content.append(text[last:])
        joined = "".join(content).strip() if calls else "".join(content)
        return (joined or None), calls
    return text, []


def finish_reason_with_tools(engine_reason: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


class ToolStreamParser:
    """Incremental counterpart of `parse_tool_output` for SSE streaming.

    feed(delta) -> (content delta or None, tool-call deltas). Named calls stream
    their arguments as generated; auto calls are sent whole once their closing
    tag arrives; "required" output is sent whole at `finish()`.
    """

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.num_calls = 0
        self._buf = ""           # auto: text not yet sent; required: everything
        self._in_call = False

    def feed(self, delta: str) -> tuple[str | None, list[DeltaToolCall]]:
        kind = self.mode.kind
        if kind == "named":
            return None, self._named(delta)
        if kind == "required":
            self._buf += delta
            return None, []
        if kind == "auto" and self.mode.tools:
            return self._auto(delta)
        return (delta or None), []

    def finish(self) -> tuple[str | None, list[DeltaToolCall]]:
        if self.mode.kind == "required":
            content, calls = parse_tool_output(self.mode, self._buf)
            return content, [self._whole(c) for c in calls]
        if self.mode.kind == "named" and self.num_calls == 0:
            return None, self._named("")
        rest, self._buf = self._buf, ""
        if self.num_calls and not self._in_call:
            rest = rest.rstrip()
        return (rest or None), []

    def _named(self, delta: str) -> list[DeltaToolCall]:
        if self.num_calls == 0:
            self.num_calls = 1
            head = DeltaToolCall(index=0, id=random_id("call_"), type="function",
                                 function=DeltaFunctionCall(name=self.mode.name, arguments=delta))
            return [head]
        if not delta:
            return []
        return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))]

    def _whole(self, call: ToolCall) -> DeltaToolCall:
        d = DeltaToolCall(index=self.num_calls, id=call.id, type="function",
                          function=DeltaFunctionCall(name=call.function.name,
                                                     arguments=call.function.arguments))
        self.num_calls += 1
        return d

    def _auto(self, delta: str) -> tuple[str | None, list[DeltaToolCall]]:
        self._buf += delta
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._buf.find(TOOL_CALL_CLOSE)
                if end < 0:
                    break
                call = _call_from_json(self._buf[len(TOOL_CALL_OPEN):end].strip())
                if call is not None and (self.mode.parallel or self.num_calls == 0):
                    calls.append(self._whole(call))
                self._buf = self._buf[end + len(TOOL_CALL_CLOSE):]
                self._in_call = False
                continue
            start = self._buf.find(TOOL_CALL_OPEN)
            if start >= 0:
                content += self._buf[:start].rstrip()
                self._buf = self._buf[start:]
                self._in_call = True
                continue
            # hold back a possible start of the open tag and trailing whitespace
            # (whitespace right before a call is dropped, as in parse_tool_output)
            keep = _partial_suffix(self._buf, TOOL_CALL_OPEN)
            ready = self._buf[:len(self._buf) - keep].rstrip()
            content += ready
            self._buf = self._buf[len(ready):]
            break
        return (content or None), calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0

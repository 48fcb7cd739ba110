"""Tool calls parsed back out of an output, whole (`parse_tool_output`) or as it
streams (`ToolStreamParser`), for the modes and the Hermes format of
gateway/tools.py: an unparseable call stays content, and without parallel calls
only the first is kept.
"""
from __future__ import annotations

import json
import re

from formwork.gateway.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolMode
from formwork.schemas.openai import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from formwork.schemas.openai_base import random_id

_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


class _Number(str):
    """A JSON number as the model wrote it. Parsed into a float, `1e999` became
    `inf` and was sent back as `Infinity`, which is not JSON; `1.10` became `1.1`."""


def _loads(text: str):
    return json.loads(text, parse_int=_Number, parse_float=_Number)


def _compact(value) -> str:
    """`value` (from `_loads`) as JSON with json.dumps' default separators, its
    numbers as written."""
    if isinstance(value, _Number):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {_compact(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_compact(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _call_from_json(text: str) -> ToolCall | None:
    try:
        obj = _loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or type(obj.get("name")) is not str:   # not a _Number
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(function=FunctionCall(name=obj["name"], arguments=_compact(args)))


def parse_tool_output(mode: ToolMode, text: str) -> tuple[str | None, list[ToolCall]]:
    """Split a finished output into (content, tool calls). Unparseable calls stay content."""
    if mode.kind == "named":
        try:
            args = _compact(_loads(text))
        except json.JSONDecodeError:
            args = text  # cut by max_tokens: hand back what was generated
        return None, [ToolCall(function=FunctionCall(name=mode.name, arguments=args))]
    if mode.kind == "required":
        try:
            obj = _loads(text)
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


def finish_reason_with_tools(engine_reason: str | None, num_calls: int, mode: ToolMode,
                             stop_reason: int | str | None = None) -> str | None:
    """"tool_calls" for an output that ended with its calls complete: a grammar-ended
    (or EOS-ended) one; a named or required call cut by a stop string or stop token
    (`stop_reason` set) stays "stop" -- its arguments may be cut short. An auto
    call is only parsed once its closing tag is out, so it is whole either way."""
    whole = mode.kind == "auto" or stop_reason is None
    return "tool_calls" if num_calls and engine_reason == "stop" and whole else engine_reason


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

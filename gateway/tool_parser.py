"""Tool calls parsed back out of an output, whole (`parse_tool_output`) or as it
streams (`ToolStreamParser`), for the modes and the call formats (Hermes, Llama 3
JSON) of gateway/tools.py: an unparseable call stays content, and without parallel
calls only the first is kept. A custom tool's call (written as a function with one
string argument `input`, or under a named custom tool_choice the whole output) comes
back as `{"type": "custom", "custom": {"name", "input"}}`.
"""
from __future__ import annotations

import json

from formwork.gateway.tools import ToolFormat, ToolMode
from formwork.schemas.openai import (CUSTOM_INPUT, CustomCall, DeltaCustomCall, DeltaFunctionCall,
                                     DeltaToolCall, FunctionCall, ToolCall)
from formwork.schemas.openai_base import random_id


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


def client_call(mode: ToolMode, call: ToolCall) -> ToolCall:
    """`call` as the client sees it: a custom tool's call (parsed as the function it is
    shown as) with its `input` string; any other call as it is."""
    if call.type != "function" or call.function.name not in mode.custom:
        return call
    try:
        value = json.loads(call.function.arguments).get(CUSTOM_INPUT)
    except (json.JSONDecodeError, AttributeError):
        value = None
    # under its constraint the arguments are {"input": "..."}; anything else is passed
    # on as written rather than lost
    text = value if isinstance(value, str) else call.function.arguments
    return ToolCall(id=call.id, type="custom", custom=CustomCall(name=call.function.name,
                                                                 input=text))


def parse_tool_output(mode: ToolMode, text: str) -> tuple[str | None, list[ToolCall]]:
    """Split a finished output into (content, tool calls). Unparseable calls stay content."""
    content, calls = _parse(mode, text)
    return content, [client_call(mode, c) for c in calls]


def _parse(mode: ToolMode, text: str) -> tuple[str | None, list[ToolCall]]:
    if mode.kind == "named" and mode.name in mode.custom:
        return None, [ToolCall(type="custom", custom=CustomCall(name=mode.name, input=text))]
    if mode.kind == "named":
        # the arguments as generated (as vLLM's): the same text a stream sends piece by
        # piece, also where max_tokens cut it
        return None, [ToolCall(function=FunctionCall(name=mode.name, arguments=text))]
    if mode.kind == "required" and not mode.tagged:
        try:
            obj = _loads(text)
        except json.JSONDecodeError:
            return text, []
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call_from_json(_compact(i)) for i in items]
        if any(c is None for c in calls):
            return text, []
        return None, calls
    if mode.tagged and mode.tools:
        fmt, calls, content, last, at = mode.format, [], [], 0, 0
        while (start := text.find(fmt.trigger, at)) >= 0:
            call, end = _call_at(fmt, text, start, mode.raw)
            if call is None:
                at = start + 1
                continue
            content.append(text[last:start])
            last = at = _after_separator(fmt, text, end)
            if mode.parallel or not calls:
                calls.append(call)
        content.append(text[last:])
        joined = "".join(content).strip() if calls else "".join(content)
        return (joined or None), calls
    return text, []


def _raw_call(fmt: ToolFormat, inner: str, raw: frozenset[str]) -> ToolCall | None:
    """A custom tool's call written raw (gateway/tools.py ToolFormat.raw_begin):
    `inner` is what stands between the tags."""
    head = len(fmt.open.strip())
    for name in raw:
        begin = fmt.raw_begin(name)[head:]
        if inner.startswith(begin):
            text = inner[len(begin):]
            tail = fmt.close[:len(fmt.close) - len(fmt.close.lstrip())]   # "\n" before the tag
            text = text[:len(text) - len(tail)] if tail and text.endswith(tail) else text
            return ToolCall(type="custom", custom=CustomCall(name=name, input=text))
    return None


def _call_at(fmt: ToolFormat, text: str, start: int,
             raw: frozenset[str] = frozenset()) -> tuple[ToolCall | None, int | None]:
    """The call that starts at `start` (where `fmt.trigger` is) and the index after it:
    (None, None) when it is not finished yet, (None, end) when what ends at `end` is
    not a call. `raw`: the custom tools whose calls carry their input raw."""
    if fmt.close:                                     # tags around the JSON
        close = fmt.close.strip()
        end = text.find(close, start)
        if end < 0:
            return None, None
        inner = text[start + len(fmt.open.strip()):end]
        call = _raw_call(fmt, inner, raw) if raw else None
        return (call or _call_from_json(inner.strip())), end + len(close)
    end = _object_end(text, start)                    # a bare JSON object
    if end is None:
        return None, None
    return _call_from_json(text[start:end]), end


def _object_end(text: str, start: int) -> int | None:
    """The index after the JSON object opening at `start` (brackets counted outside
    strings), or None when the text ends first."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _after_separator(fmt: ToolFormat, text: str, end: int) -> int:
    """`end` moved past the separator between calls (Llama's "; "), if one follows."""
    sep = fmt.separator.strip()
    if sep:
        rest = text[end:]
        stripped = rest.lstrip()
        if stripped.startswith(sep):
            return end + len(rest) - len(stripped) + len(sep)
    return end


def finish_reason_with_tools(engine_reason: str | None, num_calls: int, mode: ToolMode,
                             stop_reason: int | str | None = None) -> str | None:
    """"tool_calls" for an output that ended with its calls complete: a grammar-ended
    (or EOS-ended) one; a named or required call cut by a stop string or stop token
    (`stop_reason` set) stays "stop" -- its arguments may be cut short. An auto
    call is only parsed once its closing tag is out, so it is whole either way."""
    whole = mode.tagged or stop_reason is None
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
        self._after_call = False   # auto: a call just ended; its separator may follow
        self._held = ""            # auto: whitespace before the call being written

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
        elif self._in_call and rest:         # a call that never finished: text after all
            rest = self._held + rest
        return (rest or None), []

    def _named(self, delta: str) -> list[DeltaToolCall]:
        if self.mode.name in self.mode.custom:          # the input, as generated
            if self.num_calls == 0:
                self.num_calls = 1
                return [DeltaToolCall(index=0, id=random_id("call_"), type="custom",
                                      custom=DeltaCustomCall(name=self.mode.name, input=delta))]
            return [DeltaToolCall(index=0, custom=DeltaCustomCall(input=delta))] if delta else []
        if self.num_calls == 0:
            self.num_calls = 1
            head = DeltaToolCall(index=0, id=random_id("call_"), type="function",
                                 function=DeltaFunctionCall(name=self.mode.name, arguments=delta))
            return [head]
        if not delta:
            return []
        return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))]

    def _whole(self, call: ToolCall) -> DeltaToolCall:
        call = client_call(self.mode, call)
        if call.type == "custom":
            d = DeltaToolCall(index=self.num_calls, id=call.id, type="custom",
                              custom=DeltaCustomCall(name=call.custom.name, input=call.custom.input))
        else:
            d = DeltaToolCall(index=self.num_calls, id=call.id, type="function",
                              function=DeltaFunctionCall(name=call.function.name,
                                                         arguments=call.function.arguments))
        self.num_calls += 1
        return d

    def _auto(self, delta: str) -> tuple[str | None, list[DeltaToolCall]]:
        fmt = self.mode.format
        self._buf += delta
        content, calls = "", []
        while True:
            if self._in_call:
                call, end = _call_at(fmt, self._buf, 0, self.mode.raw)
                if end is None:
                    break                  # the call is not finished yet
                if call is None and not fmt.close:
                    # not a call after all: its text is content (a Hermes call that does
                    # not parse is dropped, as before)
                    content += self._buf[:end]
                    self._buf, self._in_call = self._buf[end:], False
                    continue
                if call is not None and (self.mode.parallel or self.num_calls == 0):
                    calls.append(self._whole(call))
                self._buf = self._buf[end:]
                self._in_call, self._after_call = False, True
                continue
            sep = fmt.separator.strip()
            if self._after_call and sep:       # the separator after a call is not content
                rest = self._buf.lstrip()
                if len(rest) < len(sep) and sep.startswith(rest):
                    break                      # not told yet
                if rest.startswith(sep):
                    self._buf = rest[len(sep):]
                self._after_call = False
                continue
            start = self._buf.find(fmt.trigger)
            if start >= 0:
                before = self._buf[:start]
                content += before.rstrip()
                self._held = before[len(before.rstrip()):]
                self._buf = self._buf[start:]
                self._in_call = True
                continue
            # hold back a possible start of the trigger and trailing whitespace
            # (whitespace right before a call is dropped, as in parse_tool_output)
            keep = _partial_suffix(self._buf, fmt.trigger)
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

"""Responses API request -> the chat-completions request it means (pure functions).

`input` items become chat messages: `message` items keep their role (content a
string or input_text / output_text parts), consecutive `function_call` and
`custom_tool_call` items become one assistant message's tool_calls, a
`function_call_output` (`custom_tool_call_output`) a tool message. `instructions`
is a system message first (never stored: OpenAI does not carry it over to a
`previous_response_id` continuation). `text.format`, function and custom `tools`
and `tool_choice` take the chat shapes, so the chat path builds the same
constraint. Every refusal is a 400 naming the Responses field; errors the chat
path raises are renamed to it by `responses_error`.
"""
from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from formwork.gateway.errors import APIError, bad_request, describe_validation_errors
from formwork.schemas.openai import ChatCompletionRequest, flat_custom_format
from formwork.schemas.responses import (INCLUDES, REASONING_EFFORTS, REASONING_SUMMARIES,
                                        UNSUPPORTED_FIELDS, ResponsesRequest)

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
# chat-request field -> Responses field, in the order tried (longest first)
_RENAMES = (("response_format.json_schema.schema", "text.format.schema"),
            ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("max_completion_tokens", "max_output_tokens"), ("messages", "input"),
            ("reasoning_effort", "reasoning.effort"))
_CHAT_TOOL = re.compile(r"^tools\[(\d+)\]\.(?:function|custom)((?:[.\[].*)?)$")


def check_supported(req: ResponsesRequest) -> None:
    """400 naming the first field formwork does not implement that the request sets,
    or an option it takes with a value it does not know."""
    for field, unused in UNSUPPORTED_FIELDS.items():
        value = getattr(req, field)
        if value not in (unused if isinstance(unused, tuple) else (unused,)):
            raise bad_request(f"{field}: is not supported by this server (got {value!r})",
                              param=field)
    allowed = {"effort": REASONING_EFFORTS, "summary": REASONING_SUMMARIES,
               "generate_summary": REASONING_SUMMARIES}      # the older name of summary
    for key, value in (req.reasoning or {}).items():
        if key not in allowed:
            raise bad_request(f"reasoning.{key}: unknown option (reasoning takes "
                              f"{', '.join(allowed)})", param=f"reasoning.{key}")
        if value is not None and value not in allowed[key]:
            raise bad_request(f"reasoning.{key}: must be one of {', '.join(allowed[key])}, "
                              f"got {value!r}", param=f"reasoning.{key}")
    for i, value in enumerate(req.include or ()):
        if value not in INCLUDES:
            raise bad_request(f"include[{i}]: unknown value {value!r} (one of "
                              f"{', '.join(INCLUDES)})", param="include")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise bad_request(f"top_logprobs: must be between 0 and 20, got {req.top_logprobs}",
                          param="top_logprobs")
    if req.max_tool_calls is not None and req.max_tool_calls < 1:
        raise bad_request(f"max_tool_calls: must be at least 1, got {req.max_tool_calls}",
                          param="max_tool_calls")


def wants_logprobs(req: ResponsesRequest) -> bool:
    """output_text logprobs: asked by `include` or by a top_logprobs above 0."""
    return "message.output_text.logprobs" in (req.include or ()) or bool(req.top_logprobs)


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param}: must be a string or a list of text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{param}[{j}].type: only text parts ({', '.join(_TEXT_PARTS[:2])}) "
                              f"are supported, got {kind!r}", param=f"{param}[{j}].type")
        texts.append(part["text"])
    return "".join(texts)


def _message(item: dict, i: int) -> dict:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"input[{i}].role: must be one of {', '.join(_ROLES)}, got {role!r}",
                          param=f"input[{i}].role")
    return {"role": role, "content": _text(item.get("content", ""), f"input[{i}].content")}


def _string(item: dict, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"input[{i}].{key}: a string is required", param=f"input[{i}].{key}")
    return value


def _add_call(messages: list[dict], item: dict, i: int) -> None:
    """A function_call (or custom_tool_call) item joins the assistant message just
    before it, if any."""
    if item.get("type") == "custom_tool_call":
        call = {"id": _string(item, "call_id", i), "type": "custom",
                "custom": {"name": _string(item, "name", i), "input": _string(item, "input", i)}}
    else:
        call = {"id": _string(item, "call_id", i), "type": "function",
                "function": {"name": _string(item, "name", i),
                             "arguments": _string(item, "arguments", i)}}
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": None}
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)


def input_messages(value: str | list[dict[str, Any]]) -> list[dict]:
    """`input` as chat message dicts (ChatMessage's shape)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, i))
        elif kind in ("function_call", "custom_tool_call"):
            _add_call(messages, item, i)
        elif kind == "reasoning":
            continue    # an earlier turn's thinking: chat templates leave it out of history
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                             "content": _text(output if output is not None else "",
                                              f"input[{i}].output")})
        else:
            raise bad_request(f"input[{i}].type: {kind!r} items are not supported; this server "
                              "takes message, function_call, function_call_output, "
                              "custom_tool_call, custom_tool_call_output and reasoning items",
                              param=f"input[{i}].type")
    if not messages:
        raise bad_request("input: at least one item is required", param="input")
    return messages


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses function and custom tools -> chat tools; built-in tools are a 400."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in ("function", "custom"):
            raise bad_request(f"tools[{i}].type: {tool.get('type')!r} tools are not supported; "
                              "this server runs function and custom tools only",
                              param=f"tools[{i}].type")
        if not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{i}].name: a string is required", param=f"tools[{i}].name")
        if tool["type"] == "custom":
            custom = {k: tool[k] for k in ("name", "description") if tool.get(k) is not None}
            if tool.get("format") is not None:
                custom["format"] = flat_custom_format(tool["format"])
            out.append({"type": "custom", "custom": custom})
            continue
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
              if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom") \
            and isinstance(choice.get("name"), str):
        return {"type": choice["type"], choice["type"]: {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools" \
            and isinstance(choice.get("tools"), list):       # the chat shape, names nested
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": [
            {"type": t.get("type"),
             "custom" if t.get("type") == "custom" else "function": {"name": t.get("name")}}
            if isinstance(t, dict) else t for t in choice["tools"]]}}
    raise bad_request(f"tool_choice: must be 'none', 'auto', 'required', "
                      f"{{'type': 'function' or 'custom', 'name': ...}} or {{'type': "
                      f"'allowed_tools', 'mode': ..., 'tools': [...]}}, got {json.dumps(choice)}",
                      param="tool_choice")


def chat_response_format(text: dict | None) -> dict | None:
    """`text.format` -> the chat `response_format` (type text / json_object / json_schema)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), (dict, bool)):
            raise bad_request("text.format.schema: a JSON schema object is required when type is "
                              "'json_schema'", param="text.format.schema")
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request(f"text.format.type: must be 'text', 'json_object' or 'json_schema', "
                      f"got {kind!r}", param="text.format.type")


# vLLM's extra request fields of /v1/responses, the chat request's own (ResponsesRequest)
VLLM_EXTRAS = ("seed", "stop", "stop_token_ids", "top_k", "min_p", "min_tokens",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
               "bad_words", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
               "structured_outputs", "chat_template_kwargs", "include_reasoning", "priority",
               "cache_salt")


def chat_request(req: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    """The chat request for `conversation` (history + this input) under `req`'s options."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    body = {"model": req.model, "messages": messages + conversation,
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
            "tools": chat_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice),
            "response_format": chat_response_format(req.text), "stream": req.stream,
            "user": req.user, "reasoning_effort": (req.reasoning or {}).get("effort")}
    if wants_logprobs(req):
        body |= {"logprobs": True, "top_logprobs": req.top_logprobs or 0}
    body |= {name: value for name in VLLM_EXTRAS if (value := getattr(req, name)) is not None}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        param, text = describe_validation_errors(e.errors())
        raise responses_error(bad_request(text, param=param)) from None


def _renamed(text: str) -> str | None:
    if m := _CHAT_TOOL.match(text):           # Responses tools are flat: tools[i].parameters,
        rest = re.sub(r"^\.format\.grammar(?=$|[.\[])", ".format", m.group(2))  # .format.syntax
        return f"tools[{m.group(1)}]{rest}"
    for old, new in _RENAMES:
        if text == old or text.startswith((old + ".", old + "[")):
            return new + text[len(old):]
    return None


def responses_error(err: APIError) -> APIError:
    """`err` from the chat path with its field named as in the Responses request (also
    where the message names the chat's response_format beside another field)."""
    new_param = _renamed(err.param) if err.param else None
    if new_param is None:
        if "response_format" not in err.message:
            return err
        return APIError(err.status, err.message.replace("response_format", "text.format"),
                        type=err.type, param=err.param, code=err.code)
    message = err.message
    if message.startswith(err.param + ":"):
        message = new_param + message[len(err.param):]
    elif err.param == "messages":            # the context-length message names its field
        message = message.replace("the messages", "the input")
    return APIError(err.status, message, type=err.type, param=new_param, code=err.code)


def truncation_starts(conversation: list[dict]) -> list[int]:
    """Where `truncation: "auto"` may start the conversation, longest first: at a later
    user message (chat templates want the conversation to open with one; a tool result
    never loses the call before it)."""
    return [i for i in range(1, len(conversation)) if conversation[i].get("role") == "user"]

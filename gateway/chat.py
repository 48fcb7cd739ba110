"""Chat messages -> prompt text and token ids, with the tools prompt.

A chat template that knows about tools (its source mentions `tools`) receives
them through `apply_chat_template(tools=...)`. Templates without tool support
(SmolLM2's plain ChatML is one) get a Hermes-style system prompt instead (under
`--tool-call-parser llama3_json` it teaches that format's calls):

    <existing system prompt, if any>

    # Tools
    You may call one or more functions ... <tools>
    {"type": "function", "function": {...}}
    </tools>
    ... <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

and earlier assistant tool calls / tool results are rendered in the same
format (`<tool_call>...</tool_call>`, `<tool_response>...</tool_response>`).
With tool_choice "none" the tools are left out of the prompt.
"""
from __future__ import annotations

import json
from typing import Any

from formwork.gateway.errors import bad_request
from formwork.gateway.tools import HERMES, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolFormat, ToolMode
from formwork.schemas.openai import CUSTOM_INPUT, ChatMessage, ToolCall

TOOLS_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "{calls}"
)
# how each call format (gateway/tools.py ToolFormat) is taught
_CALL_INSTRUCTIONS = {
    "hermes": ("For each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\n"
               f"{TOOL_CALL_OPEN}\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n'
               f"{TOOL_CALL_CLOSE}"),
    "llama3_json": ("For each function call, respond with a JSON object of the form "
                    '{"name": <function-name>, "parameters": <args-json-object>}; '
                    'separate several calls with "; ".'),
}


def template_supports_tools(tokenizer, template: str | dict | None = None) -> bool:
    """Whether the chat template (the tokenizer's, or `template` in its place) takes tools."""
    if template is None:
        template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: {"default": ..., "tool_use": ...}
        return "tool_use" in template or any("tools" in t for t in template.values())
    return "tools" in template


def tools_system_prompt(mode: ToolMode) -> str:
    lines = [json.dumps({"type": "function", "function": t.model_dump(exclude_none=True)},
                        ensure_ascii=False) for t in mode.prompt_tools]
    calls = _CALL_INSTRUCTIONS[mode.format.name]
    raw = sorted(mode.raw & {t.name for t in mode.prompt_tools})
    for name in raw:        # their calls carry the input as it is (gateway/tools.py)
        calls += (f"\n\nCall {name} with its input as it is, not as JSON:\n"
                  + mode.format.spell_raw(name, "<input>"))
    return TOOLS_PROMPT.format(tools="\n".join(lines), calls=calls)


def _text_content(msg: ChatMessage, index: int) -> str:
    if msg.content is None:
        return ""
    if isinstance(msg.content, str):
        return msg.content
    parts = []
    for j, part in enumerate(msg.content):
        if part.get("type") not in ("text", "input_text"):
            raise bad_request(
                f"messages[{index}].content: only text content parts are supported, "
                f"got type {part.get('type')!r}", param=f"messages[{index}].content")
        if not isinstance(part.get("text"), str):
            where = f"messages[{index}].content[{j}].text"
            raise bad_request(f"{where}: a text part needs its 'text' string", param=where)
        parts.append(part["text"])
    return "".join(parts)


def _arguments_obj(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


# legacy OpenAI roles: "function" is a tool result, "developer" a system prompt
_ROLES = {"developer": "system", "function": "tool"}


def _calls(msg: ChatMessage, fmt: ToolFormat,
           raw: frozenset[str]) -> list[tuple[ToolCall, str, Any, str | None]]:
    """The message's tool calls as (call, name, arguments object, raw spelling); a
    legacy `function_call` is one; a custom tool's call is the function it is shown as
    (its input the one argument: gateway/tools.py), and one of the `raw` custom tools
    is spelled as the grammar makes the model write it (its input as it is)."""
    calls = msg.tool_calls or ([ToolCall(function=msg.function_call)] if msg.function_call else [])
    out = []
    for c in calls:
        if c.type == "custom":
            name, args = c.custom.name, {CUSTOM_INPUT: c.custom.input}
            spelled = fmt.spell_raw(name, c.custom.input) if name in raw else None
        else:
            name, args, spelled = c.function.name, _arguments_obj(c.function.arguments), None
        out.append((c, name, args, spelled))
    return out


def _spelled_message(msg: ChatMessage, text: str, fmt: ToolFormat = HERMES,
                     raw: frozenset[str] = frozenset()) -> dict:
    """One message with tool calls / results spelled out for a template without tools
    (calls in the server's format)."""
    role = _ROLES.get(msg.role, msg.role)
    if msg.role == "assistant" and (calls := _calls(msg, fmt, raw)):
        spelled = fmt.separator.join(s or fmt.spell(name, args) for _, name, args, s in calls)
        text = "\n".join(([text] if text else []) + [spelled])
    if role == "tool":
        text = f"<tool_response>\n{text}\n</tool_response>"
    return {"role": role, "content": text}


def _native_message(msg: ChatMessage, text: str, fmt: ToolFormat = HERMES,
                    raw: frozenset[str] = frozenset()) -> dict:
    """One message for a template that knows tools: calls as its `tool_calls`, but
    raw ones spelled into the content as the grammar makes the model write them (the
    template would show them as JSON arguments)."""
    out: dict[str, Any] = {"role": _ROLES.get(msg.role, msg.role), "content": text}
    calls = _calls(msg, fmt, raw)
    if spelled := [s for *_, s in calls if s is not None]:
        out["content"] = "\n".join(([text] if text else []) + spelled)
    if json_calls := [(c, name, args) for c, name, args, s in calls if s is None]:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": name, "arguments": args}}
                             for c, name, args in json_calls]
    if msg.tool_call_id:
        out["tool_call_id"] = msg.tool_call_id
    if msg.name:
        out["name"] = msg.name
    return out


def render_messages(messages: list[ChatMessage], mode: ToolMode, native_tools: bool) -> list[dict]:
    """Plain dict messages for `apply_chat_template`; adds the tools prompt when needed."""
    if native_tools:
        out = [_native_message(m, _text_content(m, i), mode.format, mode.raw)
               for i, m in enumerate(messages)]
    else:
        out = [_spelled_message(m, _text_content(m, i), mode.format, mode.raw)
               for i, m in enumerate(messages)]
    if mode.in_prompt and not native_tools:
        section = tools_system_prompt(mode)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{section}".lstrip()
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def build_chat_prompt(tokenizer, messages: list[ChatMessage], mode: ToolMode,
                      template_kwargs: dict | None = None, *, add_generation_prompt: bool = True,
                      continue_final_message: bool = False,
                      add_special_tokens: bool = False,
                      chat_template: str | None = None) -> tuple[str, list[int]]:
    """Render and tokenize. Template errors are the caller's fault: 400 on `messages`.
    The keyword options are /tokenize's (vLLM's) and the offline `LLM.chat`'s; chat
    completions use the defaults. `chat_template` (also passed in `template_kwargs`
    to the renderer) decides, in place of the tokenizer's, whether tools go native."""
    native = template_supports_tools(tokenizer, chat_template)
    dicts = render_messages(messages, mode, native)
    kwargs = dict(template_kwargs or {})
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if native and mode.in_prompt:
        kwargs["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True)}
                           for t in mode.prompt_tools]
    try:
        prompt = tokenizer.apply_chat_template(
            dicts, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
    except Exception as e:  # jinja raises TemplateError / TypeError on bad conversations
        raise bad_request(f"messages: the chat template rejected the conversation: {e}",
                          param="messages") from None
    ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    return prompt, list(ids)

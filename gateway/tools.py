"""Tool calling: which constraint a `tool_choice` needs (parsing the calls back out of
the output is gateway/tool_parser.py).

In free text, calls use the Hermes format the tools prompt (gateway/chat.py) teaches:
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
or, under `--tool-call-parser llama3_json`, the one Llama 3.1-3.3's templates teach:
    {"name": "get_weather", "parameters": {"city": "Paris"}}
(`ToolFormat`: the trigger, the call's shape and the separator between calls).

tool_choice  | constraint on the output                     | parsed as
-------------|----------------------------------------------|------------------------
"none"       | none (tools are left out of the prompt)      | plain content
"auto"       | structural tag: free text; after the trigger | content + every closed
             | `<tool_call>` the call is forced to a known  | <tool_call> segment
             | name and arguments valid for its parameters; |
             | without parallel calls the output ends after |
             | the first call (xgrammar's stop_after_first) |
"required"   | JSON: one {"name", "arguments"} object (any  | the JSON value
             | tool), or an array of them if parallel;      |
             | with a raw (Lark) custom tool: one or more   | the calls, as "auto"
             | tagged calls and nothing else                |
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

Custom tools (OpenAI's `{"type": "custom", "custom": {"name", "format"}}`: the
input is one string, free or under a Lark grammar or a regex) are shown to the
model, and written by it, as a function with one string argument `input`
(`CustomTool.definition`), so every template and call format above carries them.
Named (`{"type": "custom", "custom": {"name"}}`) the output is the input itself,
under the tool's grammar as it is (a Lark grammar on llguidance, whose dialect
OpenAI's is); under "auto"/"required" the input is a JSON string, constrained by
the tool's regex (a `pattern`). A Lark grammar cannot be a JSON string's
constraint: a Lark tool's call carries its input raw between the tags,
`<tool_call>\n{"name": "calc"}\n12*7\n</tool_call>` (`ToolMode.raw`; the tag's
content is the grammar, on llguidance), and "required" is then tagged calls in
place of one JSON document (`ToolMode.tagged`); with a tag-less call format
(Llama 3's bare JSON) it is a 400 naming its format. Calls come
back as `{"type": "custom", "custom": {"name", "input"}}` (gateway/tool_parser.py).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import jsonschema

from formwork.gateway.errors import bad_request
from formwork.gateway.schema_embed import defs_prefix, embed_schema
from formwork.grammar.schema_merge import ANNOTATIONS
from formwork.grammar.schema_walk import LEGACY_DRAFTS, iter_nodes, validator_class
from formwork.schemas.openai import (AllowedToolsChoice, ChatCompletionRequest, CustomGrammar,
                                     CustomTool, FunctionDefinition, NamedCustomToolChoice,
                                     NamedToolChoice)
from formwork.schemas.structured import StructuredOutputsParams

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}
# Keywords by which an object schema says what its undeclared properties may be (or
# composes with one that may): a parameters schema with any of them keeps its meaning.
_OPENS = ("additionalProperties", "patternProperties", "unevaluatedProperties",
          "propertyNames", "minProperties", "dependencies", "dependentSchemas",
          "dependentRequired", "allOf", "anyOf", "oneOf", "not", "if", "$ref", "$dynamicRef")


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How a model writes a tool call in its text (vLLM's `--tool-call-parser`): the
    call is `open` + {"name": ..., <args_key>: {...}} + `close`, calls one after the
    other with `separator`; in free text (tool_choice auto) `trigger` starts one."""
    name: str
    trigger: str
    args_key: str
    open: str
    close: str
    separator: str

    def begin(self, fn_name: str) -> str:
        return f'{self.open}{{"name": {json.dumps(fn_name, ensure_ascii=False)}, "{self.args_key}": '

    def end(self) -> str:
        return "}" + self.close

    def spell(self, fn_name: str, arguments) -> str:
        """A call as the model writes it (prompts: the tools prompt's example, history)."""
        return self.open + json.dumps({"name": fn_name, self.args_key: arguments},
                                      ensure_ascii=False) + self.close

    @property
    def raw_calls(self) -> bool:
        """Whether a call can carry its input raw: only between tags (a closing tag
        ends it); a bare JSON call (Llama's) has nothing that could."""
        return bool(self.close.strip())

    def raw_begin(self, tool_name: str) -> str:
        """A custom tool's call whose input is written as it is, not as JSON:
        `<tool_call>\n{"name": "calc"}\n` + input + `\n</tool_call>`."""
        return f"{self.open}{json.dumps({'name': tool_name}, ensure_ascii=False)}\n"

    def spell_raw(self, tool_name: str, text: str) -> str:
        return self.raw_begin(tool_name) + text + self.close


# Hermes (Qwen2.5/Qwen3, NousResearch, formwork's own tools prompt):
#   <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
HERMES = ToolFormat("hermes", TOOL_CALL_OPEN, "arguments", TOOL_CALL_OPEN + "\n",
                    "\n" + TOOL_CALL_CLOSE, "\n")
# Llama 3.1-3.3's JSON tool calls (their chat templates' format; vLLM's llama3_json):
#   {"name": "f", "parameters": {...}}, several joined by "; "
LLAMA3_JSON = ToolFormat("llama3_json", '{"name": ', "parameters", "", "", "; ")
TOOL_FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON)}


@dataclass(frozen=True, slots=True)
class ToolMode:
    kind: str                                # "none" | "auto" | "required" | "named"
    tools: tuple[FunctionDefinition, ...]
    name: str | None = None                  # set when kind == "named"
    parallel: bool = True
    format: ToolFormat = HERMES              # how calls are written in free text
    # every tool of the request where tool_choice `allowed_tools` narrows `tools` (the
    # ones that may be called) to a subset: the prompt lists them all
    listed: tuple[FunctionDefinition, ...] | None = None
    # the custom tools of the request (among `tools`/`listed` as the functions they are
    # shown as): name -> the grammar of its input (None: free text)
    custom: Mapping[str, CustomGrammar | None] = field(default_factory=dict)

    @property
    def raw(self) -> frozenset[str]:
        """The custom tools whose calls carry their input raw (a Lark grammar cannot
        constrain a JSON string: between tags the input is written as it is)."""
        return frozenset(n for n, g in self.custom.items()
                         if g is not None and g.syntax == "lark" and self.format.raw_calls)

    @property
    def raw_callable(self) -> frozenset[str]:
        """The raw custom tools among those that may be called (`tools`)."""
        return self.raw & {t.name for t in self.tools}

    @property
    def tagged(self) -> bool:
        """Whether the calls are written in the call format's tags (parsed as in free
        text): under "auto", and under "required" where a callable tool's input is
        raw, or where one JSON Schema document cannot hold every tool's parameters
        with their meaning (one_document: different drafts) -- one or more tagged calls
        and nothing else, each call's arguments then a document of their own."""
        return self.kind == "auto" or (self.kind == "required" and (
            bool(self.raw_callable) or (self.format.raw_calls and not one_document(self.tools))))

    @property
    def in_prompt(self) -> bool:
        return self.kind != "none" and bool(self.tools)

    @property
    def prompt_tools(self) -> tuple[FunctionDefinition, ...]:
        return self.tools if self.listed is None else self.listed


def resolve_tool_mode(req: ChatCompletionRequest, fmt: ToolFormat = HERMES) -> ToolMode:
    """Validate tools/tool_choice (400 naming `tool_choice`/`tools`) and pick the mode;
    `fmt`: the server's tool-call format."""
    tools = tuple(t.definition() for t in req.tools or ())
    custom = {t.name: t.custom.grammar for t in req.tools or () if isinstance(t, CustomTool)}
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", param="tools")

    def unknown(kind: str, name: str, param: str) -> None:
        # a name picks its tool whichever type the reference says (names are unique):
        # clients that know only function tools (LangChain's tool_choice="name") name a
        # custom tool as {"type": "function", ...}
        if name not in names:
            raise bad_request(f"{param}: {kind} tool {name!r} is not among the tools "
                              f"({', '.join(names) or 'none given'})", param=param)

    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, (NamedToolChoice, NamedCustomToolChoice)):
        unknown(choice.type, choice.name, "tool_choice")
        mode = ToolMode("named", tools, choice.name, req.parallel_tool_calls, fmt, custom=custom)
    elif isinstance(choice, AllowedToolsChoice):
        for ref in choice.allowed_tools.tools:
            unknown(ref.type, ref.name, "tool_choice.allowed_tools.tools")
        allowed = {ref.name for ref in choice.allowed_tools.tools}
        subset = tuple(t for t in tools if t.name in allowed)
        mode = ToolMode(choice.allowed_tools.mode, subset, None, req.parallel_tool_calls, fmt,
                        listed=tools, custom=custom)
    else:
        if choice in ("required", "auto") and not tools and req.tool_choice is not None:
            raise bad_request(f"tool_choice: {choice!r} needs a non-empty 'tools' list",
                              param="tool_choice")
        mode = ToolMode(choice, tools, None, req.parallel_tool_calls, fmt, custom=custom)
    callable_names = {t.name for t in mode.tools}
    if mode.kind in ("auto", "required") and not fmt.raw_calls:
        for i, name in enumerate(names):
            grammar = custom.get(name)
            if grammar is not None and grammar.syntax == "lark" and name in callable_names:
                raise bad_request(
                    f"tools[{i}].custom.format: a Lark grammar is served when tool_choice "
                    f"names this custom tool ({name!r}), or where its input is written raw "
                    f"between tool-call tags; a {fmt.name} call is bare JSON, with no closing "
                    "tag to end a raw input, and a Lark grammar cannot constrain a JSON "
                    "string (a regex grammar can)", param=f"tools[{i}].custom.format")
    return mode


def custom_constraint(grammar: CustomGrammar | None) -> StructuredOutputsParams | None:
    """A named custom tool's input constraint: its regex, or its Lark grammar on
    llguidance (Lark is that backend's language); None for free text."""
    if grammar is None:
        return None
    if grammar.syntax == "regex":
        return StructuredOutputsParams(regex=grammar.definition)
    return StructuredOutputsParams(grammar=grammar.definition, backend="llguidance")


def parameters_schema(fn: FunctionDefinition) -> dict:
    """The schema a call's arguments are generated under. A function without
    parameters, or whose parameters object declares no property and says nothing about
    others (`{"type": "object", "properties": {}}`: OpenAI's, MCP's and an empty pydantic
    model's way to write "no arguments"), takes `{}`: the open object JSON Schema reads
    there let a small model invent keys (`{"[NHM] At Monaco, ...": ""}`)."""
    params = fn.parameters
    if not params:
        return dict(_NO_ARGS)
    if isinstance(params, dict) and params.get("type") == "object" and \
            not params.get("properties") and not params.get("required") and \
            not any(k in params for k in _OPENS):
        return params | {"additionalProperties": False}
    return params


def _call_schema(name: str, arguments: dict, draft4: bool) -> dict:
    # draft 4 (a wrapper may be written in it) has no `const`: `enum` there
    return {"type": "object",
            "properties": {"name": {"enum": [name]} if draft4 else {"const": name},
                           "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def _draft(params) -> type:
    """The jsonschema validator class of a parameters schema's declared draft."""
    return validator_class(params if isinstance(params, dict) else {})


# What an older draft's schema may not hold to be read the same as 2020-12 (the
# wrapper's default): tuple `items`, `additionalItems`, `dependencies` and the 2019-09
# recursion keywords changed or went; a draft-7-or-older `$ref` ignores its siblings;
# drafts 3-4 lack `const`, `contains`, `propertyNames`, `if`, and had boolean bounds
# and `id`. zod-to-json-schema's and MCP servers' draft-07 schemas mostly hold none.
_CHANGED = ("additionalItems", "dependencies", "$recursiveRef", "$recursiveAnchor")
_CHANGED_BEFORE = {
    jsonschema.Draft4Validator: ("const", "contains", "propertyNames", "if", "then", "else",
                                 "exclusiveMinimum", "exclusiveMaximum", "id"),
    jsonschema.Draft6Validator: ("if", "then", "else"),
}


def _reads_as_default(params) -> bool:
    """Whether a parameters schema means the same under the default draft (2020-12)."""
    draft = _draft(params)
    if draft is jsonschema.Draft202012Validator:
        return True
    if draft is jsonschema.Draft3Validator:
        return False
    changed = _CHANGED + _CHANGED_BEFORE.get(draft, ())
    for node in iter_nodes(params):
        n = node.schema
        if any(k in n for k in changed) or isinstance(n.get("items"), list) or \
                ("$ref" in n and draft in LEGACY_DRAFTS and set(n) - ANNOTATIONS - {"$ref"}):
            return False
    return True


def one_document(tools) -> bool:
    """Whether one JSON Schema document can hold every tool's parameters with their
    meaning: all in one draft (not draft 3, whose `required` the wrapper cannot
    write), or each read the same under the default draft."""
    params = [parameters_schema(fn) for fn in tools]
    drafts = {_draft(p) for p in params}
    return (len(drafts) <= 1 and jsonschema.Draft3Validator not in drafts) or \
        all(_reads_as_default(p) for p in params)


def _required_schema(mode: ToolMode) -> dict:
    """One {"name", "arguments"} call of any tool (an array of them if parallel), each
    tool's definitions hoisted to the root so that its `$ref`s resolve there. A draft
    all tools declare becomes the wrapper's `$schema` (a draft-04 tool's keywords keep
    their draft-04 meaning: under a 2020-12 wrapper `const` became a keyword, and
    `oneOf: [{type: string}, {const: 0}]`, which no string passes, let strings out);
    tools in different drafts share the default one only where each reads the same
    there (one_document; else the calls are tagged, or refused in a tag-less format)."""
    params = [parameters_schema(fn) for fn in mode.tools]
    if not one_document(mode.tools):
        i, p = next((i, p) for i, p in enumerate(params) if not _reads_as_default(p))
        raise bad_request(
            f"tools[{i}].function.parameters: tool_choice 'required' writes one JSON document "
            f"of calls in the {mode.format.name} format, and this tool's parameters, in "
            f"{_draft(p).__name__.removesuffix('Validator')}, would mean something else "
            "beside the other tools' (other drafts); declare one `$schema` for all of them",
            param=f"tools[{i}].function.parameters")
    drafts = {_draft(p) for p in params}
    dialect = next((p["$schema"] for p in params if isinstance(p, dict)
                    and isinstance(p.get("$schema"), str)), None) if len(drafts) == 1 else None
    params = [{k: v for k, v in p.items() if k != "$schema"} if isinstance(p, dict) else p
              for p in params]
    base = "/items/anyOf" if mode.parallel else "/anyOf"
    branches, hoisted = [], {}
    for i, (fn, p) in enumerate(zip(mode.tools, params)):
        args = embed_schema(p, f"{base}/{i}/properties/arguments", defs_prefix(fn.name, i),
                            hoisted)
        branches.append(_call_schema(fn.name, args, drafts == {jsonschema.Draft4Validator}))
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
    if mode.kind == "named" and mode.name in mode.custom:
        return custom_constraint(mode.custom[mode.name])
    if mode.kind == "named":
        fn = next(t for t in mode.tools if t.name == mode.name)
        return StructuredOutputsParams(json=parameters_schema(fn))
    # a raw call's Lark content is llguidance's alone (structural_tag.LarkContent)
    backend = "llguidance" if mode.raw_callable else "auto"
    if mode.kind == "required" and mode.tagged:
        return StructuredOutputsParams(structural_tag=_calls_tag(mode), backend=backend)
    if mode.kind == "required":
        return StructuredOutputsParams(json=_required_schema(mode))
    if mode.kind == "auto" and mode.tools:
        if answer is not None:
            return StructuredOutputsParams(structural_tag=_answer_or_calls_tag(mode, answer),
                                           backend=backend)
        return StructuredOutputsParams(structural_tag=_auto_tag(mode), backend=backend)
    return answer


def _call_tags(mode: ToolMode) -> list[dict]:
    fmt, tags = mode.format, []
    for t in mode.tools:
        if t.name in mode.raw:      # the input as it is, under its Lark grammar
            tags.append({"type": "tag", "begin": fmt.raw_begin(t.name),
                         "content": {"type": "lark", "grammar": mode.custom[t.name].definition},
                         "end": fmt.close})
        else:
            tags.append({"type": "tag", "begin": fmt.begin(t.name),
                         "content": {"type": "json_schema", "json_schema": parameters_schema(t)},
                         "end": fmt.end()})
    return tags


def _auto_tag(mode: ToolMode) -> dict:
    """xgrammar structural tag: free text, each `<tool_call>` forced into a valid call;
    stop_after_first ends the output after one call when calls are not parallel."""
    return {"type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": [mode.format.trigger],
                       "tags": _call_tags(mode), "at_least_one": False,
                       "stop_after_first": not mode.parallel}}


def _calls_tag(mode: ToolMode) -> dict:
    """xgrammar's format language: one or more tagged calls (one per line; one only
    without parallel calls) and nothing else -- tool_choice "required" where a call's
    input is raw."""
    return {"type": "structural_tag",
            "format": {"type": "tags_with_separator", "tags": _call_tags(mode),
                       "separator": mode.format.separator, "at_least_one": True,
                       "stop_after_first": not mode.parallel}}


def _answer_or_calls_tag(mode: ToolMode, answer: StructuredOutputsParams) -> dict:
    """xgrammar structural tag: the answer's JSON, or one or more tool calls (one per
    line; only one without parallel calls) and nothing else."""
    schema = {"type": "object"} if answer.kind() == "json_object" else answer.spec()
    schema = {} if schema is True else schema
    return {"type": "structural_tag",
            "format": {"type": "or", "elements": [
                {"type": "json_schema", "json_schema": schema}, _calls_tag(mode)["format"]]}}


def tag_answer(tag: dict) -> dict | bool | None:
    """The answer's JSON schema inside an `_answer_or_calls_tag`; None for any other tag."""
    fmt = tag.get("format") if isinstance(tag, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") != "or":
        return None
    first = (fmt.get("elements") or [{}])[0]
    return first.get("json_schema") if first.get("type") == "json_schema" else None


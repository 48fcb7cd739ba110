"""Pydantic models of the OpenAI HTTP protocol: chat and completions (the shared
base, model cards and errors: schemas/openai_base.py; /tokenize: openai_tokenize.py).

Requests ignore unknown fields, as OpenAI does. Fields beyond OpenAI's follow
vLLM's names: top_k, min_p, repetition_penalty, min_tokens, stop_token_ids,
ignore_eos, prompt_logprobs, structured_outputs (and the older guided_* aliases).
Mapping to engine types lives in `gateway/params.py`; this module only
describes the wire format.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (Discriminator, Field, Tag, ValidationInfo, field_validator,
                      model_serializer, model_validator)
from pydantic_core import PydanticCustomError

from formwork.schemas.errors import ParamError
from formwork.schemas.openai_base import RequestModel, ResponseModel, random_id
from formwork.schemas.sampling import MAX_N

# ---- request pieces -------------------------------------------------------------

class StreamOptions(RequestModel):
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far
    continuous_usage_stats: bool | None = False


class JsonSchemaSpec(RequestModel):
    name: str = "response"
    description: str | None = None
    # "schema" shadows a BaseModel attribute in pydantic, hence the alias.
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaSpec | None = None
    # vLLM's structural tags (type "structural_tag"): xgrammar's `format` object,
    # or the older `structures` ([{"begin", "schema", "end"}]) with `triggers`
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    @property
    def name(self) -> str:
        return self.function.name

    def definition(self) -> FunctionDefinition:
        return self.function


class CustomGrammar(RequestModel):
    definition: str
    syntax: Literal["lark", "regex"]


class CustomToolFormat(RequestModel):
    """OpenAI's custom-tool input format: free text, or a Lark grammar (llguidance's
    dialect, as OpenAI's) or a regex the input must match whole."""
    type: Literal["text", "grammar"]
    grammar: CustomGrammar | None = None

    @model_validator(mode="after")
    def _grammar_given(self) -> "CustomToolFormat":
        if self.type == "grammar" and self.grammar is None:
            raise PydanticCustomError("missing", "Field required when type is 'grammar': "
                                      "`grammar` ({definition, syntax})")
        return self


class CustomToolDefinition(RequestModel):
    name: str
    description: str | None = None
    format: CustomToolFormat | None = None

    @property
    def grammar(self) -> CustomGrammar | None:
        """The input's grammar; None for free text (`type: "text"` or no format)."""
        fmt = self.format
        return fmt.grammar if fmt is not None and fmt.type == "grammar" else None


# the one argument a custom tool's input travels in where calls are JSON (the tools
# prompt, chat templates, tool_choice auto / required): see gateway/tools.py
CUSTOM_INPUT = "input"


def flat_custom_format(fmt: Any) -> Any:
    """A custom tool's `format` in the Responses API's flat spelling (`syntax` and
    `definition` beside `type`) as chat's (`grammar: {syntax, definition}`)."""
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and "grammar" not in fmt:
        return {"type": "grammar", "grammar": {k: fmt[k] for k in ("syntax", "definition")
                                               if k in fmt}}
    return fmt


class CustomTool(RequestModel):
    """OpenAI's custom tool: its input is one string (free, or under a grammar)."""
    type: Literal["custom"]
    custom: CustomToolDefinition

    @model_validator(mode="before")
    @classmethod
    def _flat(cls, data: Any) -> Any:
        """The Responses API's flat spelling ({"type": "custom", "name", "format"}),
        which LangChain's `custom_tool` sends to chat completions too."""
        if isinstance(data, dict) and "custom" not in data and "name" in data:
            inner = {k: data[k] for k in ("name", "description") if k in data}
            if data.get("format") is not None:
                inner["format"] = flat_custom_format(data["format"])
            return {"type": data.get("type"), "custom": inner}
        return data

    @property
    def name(self) -> str:
        return self.custom.name

    def definition(self) -> FunctionDefinition:
        """The function a model is shown and writes its calls to: one string argument
        `input`, under the tool's regex where it has one (a Lark grammar cannot be
        written as a JSON string's constraint: gateway/tools.py serves it raw)."""
        grammar, text = self.custom.grammar, {"type": "string"}
        note = "Its input is free-form text."
        if grammar is not None and grammar.syntax == "regex":
            text["pattern"] = f"^(?:{grammar.definition})$"
            note = f"Its input must match this regular expression: {grammar.definition}"
        elif grammar is not None:
            note = f"Its input must follow this Lark grammar:\n{grammar.definition}"
        description = "\n\n".join(d for d in (self.custom.description, note) if d)
        return FunctionDefinition(name=self.custom.name, description=description, parameters={
            "type": "object", "properties": {CUSTOM_INPUT: text}, "required": [CUSTOM_INPUT],
            "additionalProperties": False})


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "CustomTool" if kind == "custom" else "ChatCompletionTool"


# a tool of `tools`: a function, or a custom tool (told apart by `type`)
AnyTool = Annotated[Annotated[ChatCompletionTool, Tag("ChatCompletionTool")]
                    | Annotated[CustomTool, Tag("CustomTool")], Discriminator(_tool_kind)]


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction

    @property
    def name(self) -> str:
        return self.function.name


class NamedCustomToolChoice(RequestModel):
    type: Literal["custom"]
    custom: NamedFunction

    @property
    def name(self) -> str:
        return self.custom.name


class AllowedToolRef(RequestModel):
    type: Literal["function", "custom"] = "function"
    function: NamedFunction | None = None
    custom: NamedFunction | None = None

    @model_validator(mode="after")
    def _named(self) -> "AllowedToolRef":
        if getattr(self, self.type) is None:
            raise PydanticCustomError("missing", "Field required: `{kind}` ({{name}}) for a "
                                      "{kind} tool", {"kind": self.type})
        return self

    @property
    def name(self) -> str:
        return getattr(self, self.type).name


class AllowedTools(RequestModel):
    mode: Literal["auto", "required"]
    tools: list[AllowedToolRef] = Field(min_length=1)


class AllowedToolsChoice(RequestModel):
    """OpenAI's tool_choice `allowed_tools`: `mode` ("auto" / "required") over a
    subset of `tools`; the prompt still lists every tool (a stable prompt prefix)."""
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


def _tool_choice_object(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return {"allowed_tools": "AllowedToolsChoice",
            "custom": "NamedCustomToolChoice"}.get(kind, "NamedToolChoice")


# tool_choice objects, told apart by `type` (one member's errors, not both)
ToolChoiceObject = Annotated[Annotated[NamedToolChoice, Tag("NamedToolChoice")]
                             | Annotated[NamedCustomToolChoice, Tag("NamedCustomToolChoice")]
                             | Annotated[AllowedToolsChoice, Tag("AllowedToolsChoice")],
                             Discriminator(_tool_choice_object)]


class FunctionCall(ResponseModel):
    name: str
    arguments: str


class CustomCall(ResponseModel):
    name: str
    input: str


class ToolCall(ResponseModel):
    """A function call (`function`), or a custom tool's (`type: "custom"`, `custom`)."""
    id: str = Field(default_factory=lambda: random_id("call_"))
    type: Literal["function", "custom"] = "function"
    function: FunctionCall | None = None
    custom: CustomCall | None = None

    @model_validator(mode="after")
    def _one_call(self) -> "ToolCall":
        if getattr(self, self.type) is None:
            raise PydanticCustomError("missing", "Field required: `{kind}` for a {kind} call",
                                      {"kind": self.type})
        return self

    @model_serializer(mode="wrap")
    def _only_its_kind(self, handler):
        data = handler(self)
        data.pop("custom" if self.type == "function" else "function", None)
        return data

    @property
    def name(self) -> str:
        return getattr(self, self.type).name


class ChatMessage(RequestModel):
    """`role: "function"` and an assistant's `function_call` are OpenAI's legacy
    spellings of a tool result and a tool call (rendered as those)."""
    # the published schema says what the validator below enforces
    model_config = RequestModel.model_config | {"json_schema_extra": {
        "if": {"properties": {"role": {"not": {"const": "assistant"}}}},
        "then": {"required": ["content"],
                 "properties": {"content": {"anyOf": [{"type": "string"}, {"type": "array"}]}}}}}

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None

    @field_validator("content", mode="after")
    @classmethod
    def _content_required(cls, value, info: ValidationInfo):
        """As OpenAI and vLLM: only an assistant message may leave `content` out
        (its tool calls say what it did); a user message without one was rendered as
        an empty turn."""
        role = info.data.get("role")
        if value is None and role is not None and role != "assistant":
            raise PydanticCustomError("missing", "Field required for a {role} message",
                                      {"role": role})
        return value


# vLLM request fields formwork does not serve: a request that sets one (to anything
# but its "off" value) gets a 400 naming it, instead of an answer that silently
# ignored what it asked for. Fields that change nothing formwork does (length_penalty
# without beam search, spaces_between_special_tokens, kv_transfer_params,
# vllm_xargs, request_id...) stay ignored.
# the value of an _UNSERVED field that asks for nothing, beyond null/false/empty
_UNSERVED_OFF = {"thinking_token_budget": -1}       # vLLM's "unlimited"
_UNSERVED = {
    "logits_processors": "custom logits processors are not served",
    "prompt_embeds": "prompt embeddings are not served; send text or token ids",
    "mm_processor_kwargs": "multimodal inputs are not served",
    "logprob_token_ids": "logprobs of chosen token ids are not served; use logprobs / "
                         "top_logprobs",
    "repetition_detection": "repetition detection is not served",
    "thinking_token_budget": "a thinking budget is not served (-1, unlimited, is)",
    "watermarking": "watermarking is not served",
}
_UNSERVED_CHAT = {
    "echo": "not served on chat completions (/v1/completions takes echo)",
    "documents": "RAG documents in the chat template are not served; put them in a message",
    "audio": "audio output is not served (text only)",
    "web_search_options": "web search is not served",
}


def _refuse_unserved(data: Any, table: dict[str, str]) -> None:
    if isinstance(data, dict):
        for name, why in table.items():
            value = data.get(name)
            if value not in (None, False, [], {}, "", _UNSERVED_OFF.get(name, None)):
                raise ParamError(name, why)


class _SamplingFields(RequestModel):
    """Fields shared by chat and completions requests."""

    @model_validator(mode="before")
    @classmethod
    def _unserved(cls, data: Any) -> Any:
        _refuse_unserved(data, _UNSERVED)
        return data

    model: str | None = None
    n: int = Field(default=1, json_schema_extra={"minimum": 1, "maximum": MAX_N})
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(
        default=None, json_schema_extra={"items": {"type": "integer", "minimum": 0}})
    # vLLM's beam search: `n` beams (at most 10), ranked by cumulative logprob divided by
    # length ** length_penalty (gateway/beam_search.py)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    allowed_token_ids: list[int] | None = Field(
        default=None, json_schema_extra={"items": {"type": "integer", "minimum": 0}, "minItems": 1})
    bad_words: list[str] | None = Field(default=None, json_schema_extra={
        "maxItems": 256, "items": {"type": "string", "minLength": 1, "maxLength": 256}})
    # vLLM's: logprobs name each token "token_id:<id>" (for tokens whose text is not
    # valid UTF-8 on its own); the text offsets stay those of the decoded text
    return_tokens_as_token_ids: bool = False
    # vLLM's: the response carries the prompt's token ids and each choice's output ids
    # (streamed: the prompt's in the first chunk, then each chunk's new ids)
    return_token_ids: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: served earlier under `--scheduling-policy priority` when lower; 0 otherwise
    priority: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(
        default=None, json_schema_extra={"minItems": 1, "items": {"type": "string", "minLength": 1}})
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: max_model_len); 0 is refused
    truncate_prompt_tokens: int | None = Field(default=None, json_schema_extra={"minimum": -1})
    # vLLM's: which end truncate_prompt_tokens cuts ("left", the default: keep the last
    # tokens; "right": keep the first)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: prefix-cache blocks are shared only among requests with the same salt
    cache_salt: str | None = Field(default=None, json_schema_extra={"minLength": 1})
    user: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _unserved_chat(cls, data: Any) -> Any:
        _refuse_unserved(data, _UNSERVED_CHAT)
        modalities = data.get("modalities") if isinstance(data, dict) else None
        if isinstance(modalities, list) and any(m != "text" for m in modalities):
            raise ParamError("modalities", "only \"text\" output is served")
        return data

    @model_validator(mode="after")
    def _functions_as_tools(self) -> "ChatCompletionRequest":
        """The deprecated `functions` / `function_call` as tools / tool_choice (one
        call, as that API returns one)."""
        if self.functions is None:
            if self.function_call is not None:
                raise ParamError("function_call", "needs `functions`")
            return self
        if self.tools is not None or self.tool_choice is not None:
            raise ParamError("functions", "give `tools` / `tool_choice` or the deprecated "
                                          "`functions` / `function_call`, not both")
        names = [f.name for f in self.functions]
        if isinstance(self.function_call, NamedFunction) and self.function_call.name not in names:
            raise ParamError("function_call", f"function {self.function_call.name!r} is not among "
                                              f"the functions ({', '.join(names) or 'none given'})")
        self.tools = [ChatCompletionTool(function=f) for f in self.functions]
        self.tool_choice = NamedToolChoice(function=self.function_call) \
            if isinstance(self.function_call, NamedFunction) else self.function_call
        self.parallel_tool_calls = False
        return self

    @property
    def legacy_functions(self) -> bool:
        return self.functions is not None

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[AnyTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool = True
    # OpenAI's deprecated function calling: `functions` are tools, `function_call`
    # ("none", "auto" or {"name"}) their tool_choice, one call at most; the answer
    # carries `message.function_call` and finish_reason "function_call"
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: reaches the chat template as `reasoning_effort` (templates of models
    # with an effort setting read it; others ignore it), as vLLM passes it
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # vLLM's: false leaves the thinking out of the answer (it is still generated)
    include_reasoning: bool = True
    # vLLM's: the request's own template, under --trust-request-chat-template only
    chat_template: str | None = None
    # vLLM's: no new assistant turn / continue the last (assistant) message instead
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: the tokenizer's special tokens (BOS) on top of the template's own; off, as
    # the template writes them
    add_special_tokens: bool = False


# What the server takes as a prompt (gateway/serving_completion.py refuses the
# rest with a 400): text or token ids, never empty, token ids not negative.
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
    _TOKEN_IDS,
    {"type": "array", "items": _TOKEN_IDS, "minItems": 1}]}


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(json_schema_extra=_PROMPT_SCHEMA)
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    # vLLM's: a text prompt is tokenized with the tokenizer's special tokens (the BOS
    # of Llama-3 or Mistral tokenizers), as vLLM and transformers do by default; token
    # id prompts are taken as they are
    add_special_tokens: bool = True
    # at least n (not expressible in JSON Schema: checked by the server)
    best_of: int | None = Field(default=None, json_schema_extra={"minimum": 1, "maximum": MAX_N})


# ---- responses ------------------------------------------------------------------

class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None
    # {"reasoning_tokens": n} under a --reasoning-parser: the output tokens of the thinking
    completion_tokens_details: dict[str, int] | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(ResponseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class ResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None     # absent from the JSON when no tool was called
    function_call: FunctionCall | None = None    # the deprecated `functions` API's one call
    # under --reasoning-parser: the thinking text (both of vLLM's names; absent otherwise)
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_tool_calls(self, handler):
        data = handler(self)
        for name in ("tool_calls", "function_call", "reasoning", "reasoning_content"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


class PromptLogprob(ResponseModel):
    """vLLM's prompt_logprobs entry; the response maps token id -> this, per prompt position."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsField = list[dict[int, PromptLogprob] | None] | None


class OutputCheck(ResponseModel):
    """formwork's extension field of a constrained choice (gateway/output_check.py):
    valid true / false (error says why) / null (the constraint was not re-checked)."""
    valid: bool | None
    error: str | None = None


class ChatChoice(ResponseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None          # return_token_ids; left out when None
    formwork: OutputCheck | None = None        # left out of the JSON when None


class ChatCompletionResponse(ResponseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobsField = None
    prompt_token_ids: list[int] | None = None   # return_token_ids; left out when None


class DeltaFunctionCall(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaCustomCall(ResponseModel):
    name: str | None = None
    input: str | None = None


class DeltaToolCall(ResponseModel):
    index: int
    id: str | None = None
    type: Literal["function", "custom"] | None = None
    function: DeltaFunctionCall | None = None
    custom: DeltaCustomCall | None = None


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    function_call: DeltaFunctionCall | None = None   # the deprecated `functions` API's


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None        # vLLM's: on the finish chunk only
    token_ids: list[int] | None = None          # return_token_ids: this chunk's new ids
    formwork: OutputCheck | None = None        # on the finish chunk of a constrained choice


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None   # return_token_ids: in the first chunk


class CompletionLogprobs(ResponseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsField = None
    token_ids: list[int] | None = None          # return_token_ids (vLLM: per choice, as the
    prompt_token_ids: list[int] | None = None   # prompt may differ); left out when None
    formwork: OutputCheck | None = None        # left out of the JSON when None


class CompletionResponse(ResponseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl-"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None

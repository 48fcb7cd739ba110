"""Pydantic models of the OpenAI HTTP protocol (chat, completions, models, errors).

Requests ignore unknown fields, as OpenAI does. Fields beyond OpenAI's follow
vLLM's names: top_k, min_p, repetition_penalty, min_tokens, stop_token_ids,
ignore_eos, prompt_logprobs, structured_outputs (and the older guided_* aliases).
Mapping to engine types lives in `gateway/params.py`; this module only
describes the wire format.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from formwork.schemas.errors import ParamError
from formwork.schemas.sampling import MAX_N

# Deeper request bodies are refused before any validation: no real request comes
# near it (a JSON schema nested 60 levels is still < 128), and recursive walkers
# after parsing (validation, schema compilers) would hit Python's recursion limit.
MAX_BODY_DEPTH = 128


def random_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


class InvalidBodyError(ValueError):
    """The body as a whole cannot be taken (not a field's value): 400 invalid_json."""


def _check_body(value: Any, path: str = "", depth: int = 0) -> None:
    """Refuses a body nested deeper than MAX_BODY_DEPTH and strings with a lone
    surrogate (JSON's "\\ud800" decodes to a str no tokenizer or encoder takes)."""
    if isinstance(value, str):
        if any(0xD800 <= ord(c) <= 0xDFFF for c in value):
            raise ParamError(path or "body",
                                  "contains a lone UTF-16 surrogate (not valid Unicode text)")
        return
    if isinstance(value, (dict, list)) and depth >= MAX_BODY_DEPTH:
        field = path.split(".")[0].split("[")[0]
        raise InvalidBodyError(f"the body is nested more than {MAX_BODY_DEPTH} levels deep "
                               f"(in `{field}`)")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_body(k, path, depth + 1)
            _check_body(v, f"{path}.{k}" if path else str(k), depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_body(v, f"{path}[{i}]", depth + 1)


class _Request(BaseModel):
    # allow_inf_nan=False: NaN / Infinity are not numbers any parameter accepts
    model_config = ConfigDict(extra="ignore", populate_by_name=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        _check_body(data)
        return data


class _Response(BaseModel):
    model_config = ConfigDict(populate_by_name=True)


# ---- request pieces -------------------------------------------------------------

class StreamOptions(_Request):
    include_usage: bool | None = False


class JsonSchemaSpec(_Request):
    name: str = "response"
    description: str | None = None
    # "schema" shadows a BaseModel attribute in pydantic, hence the alias.
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    id: str = Field(default_factory=lambda: random_id("call_"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    """`role: "function"` and an assistant's `function_call` are OpenAI's legacy
    spellings of a tool result and a tool call (rendered as those)."""
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None


class _SamplingFields(_Request):
    """Fields shared by chat and completions requests."""
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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
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
    user: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


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
    # at least n (not expressible in JSON Schema: checked by the server)
    best_of: int | None = Field(default=None, json_schema_extra={"minimum": 1, "maximum": MAX_N})


# ---- responses ------------------------------------------------------------------

class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class ResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None     # absent from the JSON when no tool was called

    @model_serializer(mode="wrap")
    def _drop_absent_tool_calls(self, handler):
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class PromptLogprob(_Response):
    """vLLM's prompt_logprobs entry; the response maps token id -> this, per prompt position."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsField = list[dict[int, PromptLogprob] | None] | None


class OutputCheck(_Response):
    """formwork's extension field of a constrained choice (gateway/output_check.py):
    valid true / false (error says why) / null (the constraint was not re-checked)."""
    valid: bool | None
    error: str | None = None


class ChatChoice(_Response):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    formwork: OutputCheck | None = None        # left out of the JSON when None


class ChatCompletionResponse(_Response):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobsField = None


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    formwork: OutputCheck | None = None        # on the finish chunk of a constrained choice


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(_Response):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsField = None
    formwork: OutputCheck | None = None        # left out of the JSON when None


class CompletionResponse(_Response):
    id: str = Field(default_factory=lambda: random_id("cmpl-"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "formwork"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# ---- tokenizer endpoints (vLLM's /tokenize and /detokenize) --------------------

class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    """The prompt a chat completion with the same messages (and tools) would get."""
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    # documented bounds; the vocabulary's upper one is checked by the server (the message names it)
    tokens: list[int] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}})


class DetokenizeResponse(_Response):
    prompt: str

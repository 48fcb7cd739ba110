"""Pydantic models of OpenAI's Responses API (POST /v1/responses), wire format only.

Input items stay plain dicts (gateway/responses_input.py checks them and names
the offending `input[i]...` field); the response side mirrors the openai SDK's
`openai.types.responses` objects that formwork produces: `message` items with
`output_text` parts and `function_call` items. Mapping lives in the gateway.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from formwork.schemas.openai_base import RequestModel, ResponseModel, random_id


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    text: dict[str, Any] | None = None              # {"format": {...}}
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # OpenAI's reasoning options: `effort` reaches the chat template as
    # `reasoning_effort`; no summaries are written (checked by gateway/responses_input.py)
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    # a cap on built-in tool calls; formwork serves function tools only: nothing to cap
    max_tool_calls: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # vLLM's sampling and constraint extras on /v1/responses: handed to the chat request
    # as they are (validated there, errors named by these fields)
    seed: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    top_k: Any = None
    min_p: Any = None
    min_tokens: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    bad_words: Any = None
    ignore_eos: Any = None
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    structured_outputs: Any = None
    chat_template_kwargs: Any = None
    include_reasoning: Any = None
    priority: Any = None
    cache_salt: Any = None
    # OpenAI fields formwork refuses when set (a 400 naming them, never ignored)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None


# request field -> the value that means "not used"
UNSUPPORTED_FIELDS = {"background": (None, False), "conversation": None, "prompt": None}
# the `include` values OpenAI defines; formwork adds output_text logprobs, the rest
# name outputs of tools it does not run (nothing to add) or encrypted reasoning (not kept)
INCLUDES = ("message.output_text.logprobs", "reasoning.encrypted_content",
            "file_search_call.results", "web_search_call.results",
            "web_search_call.action.sources", "message.input_image.image_url",
            "computer_call_output.output.image_url", "code_interpreter_call.outputs")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
REASONING_SUMMARIES = ("auto", "concise", "detailed")


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(ResponseModel):
    id: str = Field(default_factory=lambda: random_id("msg_"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = []


class FunctionCallItem(ResponseModel):
    id: str = Field(default_factory=lambda: random_id("fc_"))
    type: Literal["function_call"] = "function_call"
    call_id: str = Field(default_factory=lambda: random_id("call_"))
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class CustomToolCallItem(ResponseModel):
    """A custom tool's call: its `input` string (OpenAI's `custom_tool_call`)."""
    id: str = Field(default_factory=lambda: random_id("ctc_"))
    type: Literal["custom_tool_call"] = "custom_tool_call"
    call_id: str = Field(default_factory=lambda: random_id("call_"))
    name: str
    input: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningItem(ResponseModel):
    """A thinking model's reasoning (under `--reasoning-parser`), before its answer."""
    id: str = Field(default_factory=lambda: random_id("rs_"))
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = []
    content: list[ReasoningText] = []
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | FunctionCallItem | CustomToolCallItem | ReasoningItem


class ResponseUsage(ResponseModel):
    input_tokens: int = 0
    input_tokens_details: dict[str, int] = {"cached_tokens": 0}
    output_tokens: int = 0
    output_tokens_details: dict[str, int] = {"reasoning_tokens": 0}
    total_tokens: int = 0


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(ResponseModel):
    id: str = Field(default_factory=lambda: random_id("resp_"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"] = "in_progress"
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = []
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = {"format": {"type": "text"}}
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = {}

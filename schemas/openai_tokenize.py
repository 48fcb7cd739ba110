"""vLLM's /tokenize and /detokenize bodies (pydantic, the HTTP wire format only)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from formwork.schemas.openai import AnyTool, ChatMessage, ToolChoiceObject
from formwork.schemas.openai_base import RequestModel, ResponseModel

class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(RequestModel):
    """The prompt a chat completion with the same messages (and tools) would get."""
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None          # under --trust-request-chat-template only
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    tools: list[AnyTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool = True


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    # documented bounds; the vocabulary's upper one is checked by the server (the message names it)
    tokens: list[int] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}})


class DetokenizeResponse(ResponseModel):
    prompt: str

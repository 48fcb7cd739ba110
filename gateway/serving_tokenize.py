"""POST /tokenize and POST /detokenize, in vLLM's shapes; the tokenizer only, no engine.

    /tokenize   {model?, prompt, add_special_tokens=true, return_token_strs?}
              | {model?, messages, add_generation_prompt=true, continue_final_message=false,
                 add_special_tokens=false, chat_template_kwargs?, chat_template?,
                 reasoning_effort?, tools?, tool_choice?}
             -> {count, max_model_len, tokens, token_strs}
    /detokenize {model?, tokens} -> {prompt}

The messages form renders exactly as POST /v1/chat/completions does (same chat
template and tools prompt), so its `count` is that request's usage.prompt_tokens.
"""
from __future__ import annotations

from typing import Any


from formwork.gateway.chat import build_chat_prompt
from formwork.gateway.errors import bad_request, parse_body
from formwork.gateway.params import template_kwargs
from formwork.gateway.serving import ServerState
from formwork.gateway.tools import HERMES, ToolFormat, resolve_tool_mode
from formwork.schemas.openai_tokenize import (DetokenizeRequest, DetokenizeResponse,
                                              TokenizeChatRequest, TokenizeCompletionRequest,
                                              TokenizeResponse)


def parse_tokenize_request(body: dict[str, Any]) -> TokenizeChatRequest | TokenizeCompletionRequest:
    """The messages form when the body has `messages`, else the prompt form; a body
    that fits neither fails like any other request body (400 naming the field)."""
    return parse_body(TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest,
                      body)


def _chat_ids(tokenizer, req: TokenizeChatRequest, kwargs: dict | None,
              fmt: ToolFormat) -> list[int]:
    _, ids = build_chat_prompt(tokenizer, req.messages, resolve_tool_mode(req, fmt), kwargs,
                               add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message,
                               add_special_tokens=req.add_special_tokens,
                               chat_template=req.chat_template)
    return ids


def _tokenize(tokenizer, req: TokenizeChatRequest | TokenizeCompletionRequest,
              kwargs: dict | None = None, fmt: ToolFormat = HERMES
              ) -> tuple[list[int], list[str] | None]:
    if isinstance(req, TokenizeChatRequest):
        ids = _chat_ids(tokenizer, req, kwargs, fmt)
    else:
        ids = list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    return ids, (tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None)


async def tokenize(state: ServerState, body: dict[str, Any]) -> TokenizeResponse:
    """Templating and tokenizing run on a tokenizer worker thread (gateway/tokenizer_pool.py)."""
    req = parse_tokenize_request(body)
    state.check_model(req.model)
    if (isinstance(req, TokenizeChatRequest) and req.continue_final_message
            and req.add_generation_prompt):
        raise bad_request("continue_final_message: cannot be used together with "
                          "add_generation_prompt=true; set add_generation_prompt to false",
                          param="continue_final_message")
    kwargs = template_kwargs(state, req) if isinstance(req, TokenizeChatRequest) else None
    ids, strs = await state.run_tokenizer(_tokenize, req, kwargs, state.tool_format)
    return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids,
                            token_strs=strs)


def detokenize(state: ServerState, req: DetokenizeRequest) -> DetokenizeResponse:
    """Special tokens are kept, as vLLM does: detokenize(tokenize(x).tokens) == x."""
    state.check_model(req.model)
    vocab = len(state.tokenizer)
    for i, token in enumerate(req.tokens):
        if not 0 <= token < vocab:
            raise bad_request(f"tokens[{i}]: token id {token} is outside the vocabulary "
                              f"[0, {vocab})", param=f"tokens[{i}]")
    return DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens))

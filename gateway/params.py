"""OpenAI request fields -> SamplingParams / StructuredOutputsParams.

Pure functions; every refusal is an APIError 400 naming the request field.
"""
from __future__ import annotations

import msgspec

from formwork.gateway.errors import APIError, bad_request
from formwork.schemas.openai import ChatCompletionRequest, CompletionRequest
from formwork.schemas.sampling import SamplingParams
from formwork.schemas.structured import StructuredOutputsParams

_PASSTHROUGH = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                "ignore_eos", "skip_special_tokens", "include_stop_str_in_output")


def _response_format(req: ChatCompletionRequest | CompletionRequest) -> StructuredOutputsParams | None:
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.json_schema is None or rf.json_schema.json_schema is None:
        raise bad_request("response_format.json_schema: a 'json_schema' object with a 'schema' "
                          "is required when type is 'json_schema'",
                          param="response_format.json_schema")
    return StructuredOutputsParams(json=rf.json_schema.json_schema)


def _extension(req: ChatCompletionRequest | CompletionRequest) -> StructuredOutputsParams | None:
    raw = dict(req.structured_outputs or {})
    for old, new in (("guided_json", "json"), ("guided_regex", "regex"),
                     ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(req, old) is not None:
            raw[new] = getattr(req, old)
    if not raw:
        return None
    try:
        return msgspec.convert(raw, StructuredOutputsParams)
    except msgspec.ValidationError as e:
        raise bad_request(f"structured_outputs: {e}", param="structured_outputs") from None


def structured_from_request(
        req: ChatCompletionRequest | CompletionRequest,
        tool_constraint: StructuredOutputsParams | None = None,
) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's single output constraint and the field it came from."""
    found = [(p, name) for p, name in ((_response_format(req), "response_format"),
                                       (_extension(req), "structured_outputs"),
                                       (tool_constraint, "tools")) if p is not None]
    if len(found) > 1:
        names = " and ".join(name for _, name in found)
        raise bad_request(f"{found[1][1]}: only one output constraint per request, got {names}",
                          param=found[1][1])
    return found[0] if found else (None, None)


def validate_constraint(params: StructuredOutputsParams, source: str,
                        default_backend: str = "auto") -> None:
    """Check the constraint before it is queued: a bad schema / regex / grammar is a 400."""
    from formwork.core.validation import validate_structured  # pulls in grammar backends: lazily
    try:
        params.validate()
        validate_structured(params, default_backend)
    except ValueError as e:
        raise bad_request(f"{source}: {e}", param=source) from None


def context_max_tokens(prompt_len: int, requested: int | None, max_model_len: int,
                       prompt_param: str) -> int:
    """The max_tokens to send: `requested`, or what the context leaves when None."""
    total = prompt_len + (requested or 0)
    if prompt_len >= max_model_len or total > max_model_len:
        detail = f"{prompt_len} in the {prompt_param}"
        if requested is not None:
            detail += f", {requested} in the completion"
        raise APIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {max(total, prompt_len)} tokens ({detail}). Please reduce the length of "
            f"the {prompt_param} or completion.", param=prompt_param, code="context_length_exceeded")
    return requested if requested is not None else max_model_len - prompt_len


def sampling_params(req: ChatCompletionRequest | CompletionRequest, *, max_tokens: int,
                    logprobs: int | None, structured: StructuredOutputsParams | None,
                    rename: dict[str, str] | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """Build SamplingParams; its ValueError "param: msg" becomes a 400 on the request field
    (`rename` maps engine names to request names, e.g. logprobs -> top_logprobs)."""
    fields = {k: getattr(req, k) for k in _PASSTHROUGH if getattr(req, k) is not None}
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs,
                              structured_outputs=structured, **fields)
    except ValueError as e:
        text = str(e)
        param = text.split(":", 1)[0] if ":" in text else None
        if param and rename and param in rename:
            text = rename[param] + text[len(param):]
            param = rename[param]
        raise bad_request(text, param=param) from None


def explicit_prompt_logprobs(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """vLLM's `prompt_logprobs` extra field: refused with stream (as vLLM, when > 0)."""
    n = req.prompt_logprobs
    if n is not None and req.stream and n > 0:
        raise bad_request("prompt_logprobs: are not available when stream is true",
                          param="prompt_logprobs")
    return n


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs: requires 'logprobs' to be true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise bad_request(f"top_logprobs: must be in [0, 20], got {req.top_logprobs}",
                          param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def chat_max_tokens(req: ChatCompletionRequest) -> tuple[int | None, str]:
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"

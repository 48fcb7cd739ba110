"""OpenAI request fields -> SamplingParams / StructuredOutputsParams.

Pure functions; every refusal is an APIError 400 naming the request field.
"""
from __future__ import annotations

import asyncio
import logging

import msgspec

from formwork.gateway.constraint_check import ConstraintChecker
from formwork.gateway.errors import APIError, bad_request, from_value_error
from formwork.gateway.serve_options import jinja_syntax_error
from formwork.gateway.tools import ToolMode, tool_constraint
from formwork.grammar.selection import validate_params
from formwork.schemas.errors import msgspec_refusal
from formwork.schemas.openai import ChatCompletionRequest, CompletionRequest
from formwork.schemas.sampling import (SamplingParams, check_priority, check_token_ids,
                                       resolve_bad_words, with_stop_ids)
from formwork.schemas.structured import FALSE_SCHEMA, KINDS, StructuredOutputsParams, is_set

_log = logging.getLogger("formwork.gateway.requests")
_PASSTHROUGH = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "priority",
                "cache_salt", "allowed_token_ids", "bad_words")
MAX_TEMPERATURE = 2.0        # OpenAI's bound (the offline SamplingParams has none, as vLLM)
# vLLM's structured_outputs options -> formwork's fields (a False is vLLM's default: no change)
_VLLM_FLAGS = {"disable_any_whitespace": ("whitespace", "compact"),
               "disable_additional_properties": ("additional_properties", "declared"),
               "disable_fallback": None}     # formwork never falls back from a named backend
# vLLM's guided_decoding_backend options ("xgrammar:disable-any-whitespace,no-fallback")
_BACKEND_OPTIONS = {"disable-any-whitespace": "disable_any_whitespace",
                    "no-additional-properties": "disable_additional_properties",
                    "no-fallback": "disable_fallback"}
_FIELDS = frozenset(StructuredOutputsParams.__struct_fields__)


def _response_format(req: ChatCompletionRequest | CompletionRequest) -> StructuredOutputsParams | None:
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.type == "structural_tag":
        if rf.format is not None:
            tag = {"type": "structural_tag", "format": rf.format}
        elif rf.structures is not None and rf.triggers is not None:
            tag = {"type": "structural_tag", "structures": rf.structures, "triggers": rf.triggers}
        else:
            raise bad_request("response_format: type 'structural_tag' needs a 'format' (xgrammar's "
                              "structural tag) or 'structures' and 'triggers'",
                              param="response_format")
        return StructuredOutputsParams(structural_tag=tag)
    if rf.json_schema is None or rf.json_schema.json_schema is None:
        raise bad_request("response_format.json_schema: a 'json_schema' object with a 'schema' "
                          "is required when type is 'json_schema'",
                          param="response_format.json_schema")
    if rf.json_schema.json_schema is False:
        raise bad_request(f"response_format.json_schema.schema: {FALSE_SCHEMA}",
                          param="response_format.json_schema.schema")
    return StructuredOutputsParams(json=rf.json_schema.json_schema)


def _vllm_options(raw: dict, param: str) -> dict:
    """vLLM's option names in `raw` (structured_outputs) as formwork's fields; any
    other unknown field is a 400 (never silently ignored)."""
    out = {k: v for k, v in raw.items() if k not in _VLLM_FLAGS}
    for key in raw.keys() & _VLLM_FLAGS.keys():
        if not isinstance(raw[key], bool):
            raise bad_request(f"{param}.{key}: must be a boolean", param=f"{param}.{key}")
        if raw[key] and _VLLM_FLAGS[key] is not None:
            field, value = _VLLM_FLAGS[key]
            if out.get(field, value) != value:
                raise bad_request(f"{param}.{key}: contradicts {field}={out[field]!r}",
                                  param=f"{param}.{key}")
            out[field] = value
    unknown = sorted(k for k in out if k not in _FIELDS)
    if unknown:
        raise bad_request(f"{param}.{unknown[0]}: unknown field; known: {', '.join(sorted(_FIELDS))}"
                          f", and vLLM's {', '.join(_VLLM_FLAGS)}", param=f"{param}.{unknown[0]}")
    return out


def _backend_options(req: ChatCompletionRequest | CompletionRequest) -> dict:
    """Top-level guided_decoding_backend ("name[:opt,opt]") and guided_whitespace_pattern
    as structured_outputs fields."""
    out: dict = {}
    if req.guided_decoding_backend is not None:
        name, _, opts = req.guided_decoding_backend.partition(":")
        out["backend"] = name.strip()
        for opt in filter(None, (o.strip() for o in opts.split(","))):
            if opt not in _BACKEND_OPTIONS:
                raise bad_request(f"guided_decoding_backend: unknown option {opt!r}; known: "
                                  f"{', '.join(_BACKEND_OPTIONS)}", param="guided_decoding_backend")
            out[_BACKEND_OPTIONS[opt]] = True
    if req.guided_whitespace_pattern is not None:
        out["whitespace_pattern"] = req.guided_whitespace_pattern
    return out


def _extension(req: ChatCompletionRequest | CompletionRequest
               ) -> tuple[StructuredOutputsParams | None, dict]:
    """(vLLM's structured_outputs / guided_* constraint or None, the options given
    without a constraint: they apply to the response_format's or the tools')."""
    raw = _vllm_options(dict(req.structured_outputs or {}), "structured_outputs")
    for old, new in (("guided_json", "json"), ("guided_regex", "regex"),
                     ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(req, old) is not None:
            raw[new] = getattr(req, old)
    if not raw or not any(is_set(k, raw.get(k)) for k in KINDS):
        return None, {k: v for k, v in raw.items() if k not in KINDS}
    if raw.get("json") is False:
        raise bad_request(f"structured_outputs.json: {FALSE_SCHEMA}",
                          param="structured_outputs.json")
    if raw.get("json") is True:       # the schema `true`: any JSON value, as `{}`
        raw["json"] = {}
    try:
        return msgspec.convert(raw, StructuredOutputsParams), {}
    except msgspec.ValidationError as e:
        raise from_value_error(msgspec_refusal(e, "structured_outputs")) from None


def _with_options(params: StructuredOutputsParams | None, opts: dict,
                  param: str) -> StructuredOutputsParams | None:
    """`params` with options (backend, whitespace, ...) set; a 400 naming `param`
    when one contradicts what the constraint already says. No constraint: nothing
    to apply them to (as vLLM)."""
    if params is None or not opts:
        return params
    default = StructuredOutputsParams(json={})
    for field, value in opts.items():
        if getattr(params, field) not in (getattr(default, field), value):
            raise bad_request(f"{param}: contradicts the constraint's {field}="
                              f"{getattr(params, field)!r}", param=param)
    try:
        return msgspec.convert(msgspec.to_builtins(params) | opts, StructuredOutputsParams)
    except msgspec.ValidationError as e:
        raise from_value_error(msgspec_refusal(e, param)) from None


def structured_from_request(
        req: ChatCompletionRequest | CompletionRequest, tools: ToolMode | None = None,
) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field it came from.

    One of response_format / structured_outputs (and the guided_* aliases). With
    tools, `tools.kind` decides (gateway/tools.py): "none" keeps that constraint,
    "required"/named replace the response_format by the tool constraint, "auto"
    combines them (an answer in the format, or tool calls)."""
    fmt, (ext, ext_options) = _response_format(req), _extension(req)
    found = [(p, name) for p, name in ((fmt, "response_format"), (ext, "structured_outputs"))
             if p is not None]
    uses_tools = tools is not None and tools.kind != "none" and bool(tools.tools)
    # a response_format is the final answer's format beside tools; a structural tag
    # (free text with tagged segments) has no place beside the tools' own tag
    if uses_tools and (ext is not None or (fmt is not None and fmt.kind() == "structural_tag")):
        found.append((None, "tools"))
    if len(found) > 1:
        names = " and ".join(name for _, name in found)
        raise bad_request(f"{found[1][1]}: only one output constraint per request, got {names}",
                          param=found[1][1])
    constraint, source = found[0] if found else (None, None)
    if uses_tools:
        constraint, source = tool_constraint(tools, constraint), "tools"
    constraint = _with_options(constraint, ext_options, "structured_outputs")
    top = _backend_options(req)
    param = "guided_whitespace_pattern" if "whitespace_pattern" in top else "guided_decoding_backend"
    return _with_options(constraint, _vllm_options(top, param), param), source


_WHITESPACE_FIELDS = frozenset({"whitespace", "max_whitespace", "whitespace_pattern",
                                "disable_any_whitespace"})


def with_server_whitespace(req: ChatCompletionRequest | CompletionRequest,
                           params: StructuredOutputsParams | None,
                           whitespace: str | None) -> StructuredOutputsParams | None:
    """The server's JSON whitespace default (vLLM's --structured-outputs-config
    disable_any_whitespace: "compact") on the constraint of a request that says
    nothing about whitespace; a request's own (structured_outputs' whitespace fields,
    guided_whitespace_pattern, a guided_decoding_backend option) stays."""
    if params is None or whitespace is None:
        return params
    named = _WHITESPACE_FIELDS & set(req.structured_outputs or {}) \
        or req.guided_whitespace_pattern is not None \
        or "whitespace" in (req.guided_decoding_backend or "")
    return params if named else msgspec.structs.replace(params, whitespace=whitespace)


def validate_constraint(params: StructuredOutputsParams, source: str,
                        default_backend: str = "auto") -> None:
    """Check the constraint before it is queued: a bad schema / regex / grammar is a 400."""
    try:
        validate_params(params, default_backend)      # params.validate() first
    except ValueError as e:
        raise bad_request(f"{source}: {e}", param=source) from None


async def check_constraint(checker: ConstraintChecker | None, params: StructuredOutputsParams,
                           source: str, default_backend: str = "auto") -> None:
    """`validate_constraint` off the event loop: in the server's checking process
    (gateway/constraint_check.py: native code that crashes takes only that process
    down), or on a thread where there is none (the unit tests' apps)."""
    if checker is None:
        await asyncio.to_thread(validate_constraint, params, source, default_backend)
        return
    message = await checker.check(params, default_backend)
    if message is not None:
        raise bad_request(f"{source}: {message}", param=source)


def context_max_tokens(prompt_len: int, requested: int | None, max_model_len: int,
                       prompt_param: str, default: int | None = None) -> int:
    """The max_tokens to send: `requested`, or when None what the context leaves (at
    most `default`: the generation config's max_new_tokens)."""
    total = prompt_len + (requested or 0)
    if prompt_len >= max_model_len or total > max_model_len:
        detail = f"{prompt_len} in the {prompt_param}"
        if requested is not None:
            detail += f", {requested} in the completion"
        raise APIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {max(total, prompt_len)} tokens ({detail}). Please reduce the length of "
            f"the {prompt_param} or completion.", param=prompt_param, code="context_length_exceeded")
    if requested is not None:
        return requested
    room = max_model_len - prompt_len
    return min(int(default), room) if default else room


def sampling_params(req: ChatCompletionRequest | CompletionRequest, *, max_tokens: int,
                    logprobs: int | None, structured: StructuredOutputsParams | None,
                    rename: dict[str, str] | None = None,
                    prompt_logprobs: int | None = None,
                    vocab_size: int | None = None,
                    scheduling_policy: str = "fcfs", tokenizer=None,
                    defaults: dict | None = None,
                    extra_stop_ids: tuple[int, ...] = ()) -> SamplingParams:
    """Build SamplingParams; its ValueError "param: msg" becomes a 400 on the request field
    (`rename` maps engine names to request names, e.g. logprobs -> top_logprobs).
    `vocab_size`: token ids (stop_token_ids, logit_bias) are checked against it. A
    `priority` other than 0 needs the server's scheduling_policy "priority" (as vLLM).
    `tokenizer`: turns bad_words into token sequences (`resolve_bad_words`).
    `defaults`: sampling values for fields the request leaves out (the server's
    generation config, gateway/serve_options.py); `extra_stop_ids`: its end ids beside
    the tokenizer's, stop ids unless the request ignores the end."""
    fields = {k: getattr(req, k) for k in _PASSTHROUGH if getattr(req, k) is not None}
    for name, value in (defaults or {}).items():
        if name != "max_tokens" and getattr(req, name, None) is None:
            fields[name] = value
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    if req.temperature is not None and req.temperature > MAX_TEMPERATURE:
        raise bad_request(f"temperature: must be in [0, {MAX_TEMPERATURE:g}], got {req.temperature}",
                          param="temperature")
    try:
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs, structured_outputs=structured,
                                logit_bias=_logit_bias(req), **fields)
        if tokenizer is not None:
            resolve_bad_words(params, tokenizer)
        if vocab_size is not None:
            check_token_ids(params, vocab_size)
        check_priority(params, scheduling_policy)
    except ValueError as e:
        text = str(e)
        param = text.split(":", 1)[0] if ":" in text else None
        if param and rename and param in rename:
            text = rename[param] + text[len(param):]
            param = rename[param]
        raise bad_request(text, param=param) from None
    check_min_tokens(params)
    return with_stop_ids(params, extra_stop_ids)


def _logit_bias(req: ChatCompletionRequest | CompletionRequest) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} with integer keys (range checks: SamplingParams)."""
    if not req.logit_bias:
        return None
    out = {}
    for key, bias in req.logit_bias.items():
        try:
            out[int(key)] = float(bias)
        except ValueError:
            raise bad_request(f"logit_bias: keys must be token ids (integers as strings), "
                              f"got {key!r}", param="logit_bias") from None
    return out


def check_min_tokens(params: SamplingParams) -> None:
    """400 before queueing for a min_tokens no output of a `choice` constraint can
    reach: a choice of b UTF-8 bytes takes at most b tokens (one per byte)."""
    so = params.structured_outputs
    if not params.min_tokens or so is None or so.kind() != "choice":
        return
    longest = max(len(c.encode("utf-8")) for c in so.choice)
    if params.min_tokens > longest:
        raise bad_request(
            f"min_tokens: {params.min_tokens} tokens cannot be generated under this choice "
            f"constraint: its longest choice is {longest} bytes, at most {longest} tokens",
            param="min_tokens")


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


def check_max_logprobs(params: SamplingParams, cap: int, name: str) -> None:
    """400 for more logprobs than the server's --max-logprobs (`name`: the request's
    field for the per-token ones)."""
    for field_name, value in ((name, params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
        if value is not None and value > cap:
            raise bad_request(f"{field_name}: at most {cap} (this server's --max-logprobs), "
                              f"got {value}", param=field_name)


def request_chat_template(state, template: str) -> str:
    """A request's own chat_template: only under --trust-request-chat-template (as
    vLLM), and one Jinja can parse (the tokenizer renders it in a sandbox)."""
    if not state.options.trust_request_chat_template:
        raise bad_request("chat_template: a per-request chat template is not accepted (as vLLM "
                          "without --trust-request-chat-template); the model's own template is "
                          "used", param="chat_template")
    if (error := jinja_syntax_error(template)) is not None:
        raise bad_request(f"chat_template: not a valid Jinja template: {error}",
                          param="chat_template")
    return template


def template_kwargs(state, req) -> dict | None:
    """The chat template's keyword arguments of a chat (or /tokenize) request: its
    `chat_template_kwargs`, its `reasoning_effort` (the former's own value wins), the
    server's --default-chat-template-kwargs under both, and its own `chat_template`
    (trusted servers only)."""
    kwargs = req.chat_template_kwargs
    if req.reasoning_effort is not None:
        kwargs = {"reasoning_effort": req.reasoning_effort, **(kwargs or {})}
    if state.options.default_chat_template_kwargs:
        kwargs = {**state.options.default_chat_template_kwargs, **(kwargs or {})}
    if req.chat_template is not None:
        kwargs = {**(kwargs or {}), "chat_template": request_chat_template(state, req.chat_template)}
    return kwargs


def log_request(state, request_id: str, prompt: str | None, params) -> None:
    """--enable-log-requests: one line per generation request (the prompt cut to
    --max-log-len characters)."""
    if not state.options.log_requests:
        return
    cut = state.options.max_log_len
    shown = prompt if prompt is None or cut is None else prompt[:cut]
    _log.info("request %s: prompt %r, params %s", request_id, shown, params)

"""POST /v1/chat/completions: request -> prompt + SamplingParams -> JSON or SSE."""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from formwork.gateway.beam_search import check_beam_request, serve_beam_search
from formwork.gateway.chat import build_chat_prompt
from formwork.gateway.errors import APIError, bad_request
from formwork.gateway.limits import check_text_fits, truncated_prompt
from formwork.gateway.metrics import Metrics, RequestTimer
from formwork.gateway.output_check import (Verdict, check_output, drop_unset, lark_grammars,
                                           prepare_lark)
from formwork.gateway.output_processor import CompletionOutput, RequestOutput
from formwork.gateway.params import (chat_logprobs, chat_max_tokens, check_max_logprobs,
                                     context_max_tokens, explicit_prompt_logprobs, log_request,
                                     sampling_params, template_kwargs,
                                     structured_from_request, check_constraint,
                                     with_server_whitespace)
from formwork.gateway.reasoning import END, ReasoningSplitter, split_reasoning, thinks_first
from formwork.gateway.serving import (ServerState, TokenText, blame, generate_final, primed,
                             run_until_disconnect, sse, sse_error, stream_outputs)
from formwork.gateway.completion_logprobs import prompt_logprobs_field
from formwork.gateway.tool_parser import ToolStreamParser, finish_reason_with_tools, parse_tool_output
from formwork.gateway.tools import (ToolMode, custom_constraint, parameters_schema, resolve_tool_mode,
                                    tag_answer)
from formwork.schemas.engine import TokenLogprobs
from formwork.schemas.openai import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                            ChatCompletionResponse, ChatStreamChoice, ChoiceLogprobs, DeltaMessage,
                            ResponseMessage, TokenLogprob, TopLogprob, UsageInfo)
from formwork.schemas.openai_base import random_id
from formwork.schemas.sampling import SamplingParams
from formwork.schemas.structured import StructuredOutputsParams


@dataclass(slots=True)
class PreparedChat:
    model: str
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    mode: ToolMode
    source: str | None       # request field of the output constraint, if any
    token_ids_as_names: bool = False    # return_tokens_as_token_ids
    reasoning: str | None = None        # the reasoning parser, where it applies
    token_ids: bool = False             # return_token_ids
    include_reasoning: bool = True      # false: the thinking is left out of the answer
    legacy_functions: bool = False      # the deprecated `functions` API: `function_call` out


def _texts(content) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


async def _blame_a_tool(state: ServerState, req: ChatCompletionRequest, mode: ToolMode) -> None:
    """The combined tool constraint was refused: raise the first tool's own refusal,
    named `tools[i].function.parameters` with its path inside that schema, or a custom
    tool's `tools[i].custom.format.grammar.definition` (the combined one's error
    points into formwork's wrapper: `$.format.tags[0]...`, or a call list's
    `minItems`). Returns where no tool fails alone (the answer format)."""
    index = {t.name: i for i, t in enumerate(req.tools or ())}
    backend = state.engine.config.structured_backend
    for fn in mode.tools:
        if mode.kind == "named" and fn.name != mode.name:
            continue
        i = index.get(fn.name, 0)
        if fn.name in mode.custom:      # a custom tool: its grammar as it is, then as a call's
            if (grammar := mode.custom[fn.name]) is None:
                continue
            where = f"tools[{i}].custom.format.grammar.definition"
            await check_constraint(state.constraints, custom_constraint(grammar), where, backend)
            if mode.kind == "named" or fn.name in mode.raw:     # its grammar is the constraint
                continue
        else:
            where = f"tools[{i}].function.parameters"
        await check_constraint(state.constraints, StructuredOutputsParams(
            json=parameters_schema(fn)), where, backend)


_ANSWER_PATH = "$.format.elements[0].json_schema"       # tools.tag_answer's place


def _answer_refusal(req: ChatCompletionRequest, structured: StructuredOutputsParams,
                    err: APIError) -> APIError | None:
    """Where no tool fails alone, the response_format beside them is what the combined
    constraint could not serve (tool_choice auto: the answer or calls, one structural
    tag, where a keyword served alone may not be): its refusal names
    `response_format` and the path inside the answer's own schema, not the wrapper's."""
    if req.response_format is None or tag_answer(structured.structural_tag or {}) is None:
        return None
    reason = err.message.removeprefix(f"{err.param}: ") if err.param else err.message
    reason = reason.replace(_ANSWER_PATH + ".", "$.").replace(_ANSWER_PATH, "$")
    return bad_request(f"response_format: beside tools (tool_choice auto) the answer is served "
                       f"inside the tool-call constraint, where this schema is refused: {reason}",
                       param="response_format")


async def prepare_chat(state: ServerState, req: ChatCompletionRequest) -> PreparedChat:
    """All validation before anything is queued. The constraint check runs in a worker
    thread (it may compile); templating and tokenizing on a tokenizer worker thread
    with its own tokenizer copy (gateway/tokenizer_pool.py)."""
    model = state.check_model(req.model)
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request("continue_final_message: cannot be used together with "
                          "add_generation_prompt=true; set add_generation_prompt to false",
                          param="continue_final_message")
    mode = resolve_tool_mode(req, state.tool_format)
    structured, source = structured_from_request(req, mode)
    structured = with_server_whitespace(req, structured, state.options.structured_whitespace)
    if req.use_beam_search:
        check_beam_request(req, source, chat=True)
    if structured is not None:
        try:
            await check_constraint(state.constraints, structured, source,
                                   state.engine.config.structured_backend)
        except APIError as err:
            if source == "tools" and mode is not None:
                await _blame_a_tool(state, req, mode)
                if (answer := _answer_refusal(req, structured, err)) is not None:
                    raise answer from None
            raise
        if grammars := lark_grammars(structured, mode):      # the output check's parsers
            await asyncio.to_thread(prepare_lark, grammars)
    if req.truncate_prompt_tokens is None:     # a truncated prompt may be longer (body limit)
        check_text_fits((t for m in req.messages for t in _texts(m.content)),
                        state.max_model_len, state.max_token_chars, "messages")
    prompt, ids = await state.run_tokenizer(
        build_chat_prompt, req.messages, mode, template_kwargs(state, req),
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, chat_template=req.chat_template,
        add_special_tokens=req.add_special_tokens)
    kept = truncated_prompt(ids, req.truncate_prompt_tokens, state.max_model_len,
                            req.truncation_side)
    if len(kept) < len(ids):
        ids = kept
        prompt = await state.run_tokenizer(lambda tok: tok.decode(kept, skip_special_tokens=False))
    requested, max_param = chat_max_tokens(req)
    max_tokens = context_max_tokens(len(ids), requested, state.max_model_len, "messages",
                                    state.default_sampling.get("max_tokens"))
    params = sampling_params(req, max_tokens=max_tokens, logprobs=chat_logprobs(req),
                             structured=structured, prompt_logprobs=explicit_prompt_logprobs(req),
                             rename={"max_tokens": max_param, "logprobs": "top_logprobs"},
                             vocab_size=len(state.tokenizer),
                             scheduling_policy=state.scheduling_policy, tokenizer=state.tokenizer,
                             defaults=state.default_sampling,
                             extra_stop_ids=state.extra_stop_ids)
    check_max_logprobs(params, state.options.max_logprobs, "top_logprobs")
    return PreparedChat(model, prompt, ids, params, mode, source,
                        req.return_tokens_as_token_ids or state.options.return_tokens_as_token_ids,
                        _reasoning(state, req, mode, prompt, params), req.return_token_ids,
                        req.include_reasoning, req.legacy_functions)


def _reasoning(state: ServerState, req: ChatCompletionRequest, mode: ToolMode, prompt: str,
               params: SamplingParams) -> str | None:
    """The reasoning parser that splits this request's output, if any. Free text (no
    constraint, or tools under tool_choice auto) may start with thinking: the server's
    parser. A constrained output thinks first, then follows its constraint after the
    end tag, where the model writes that tag as one token (Qwen3, DeepSeek-R1:
    grammar/reasoning_matcher.py) and the prompt did not close the thinking: all it
    writes before the tag is thinking (deepseek_r1's rule, whatever the parser); else
    it is constrained from its first token and does not think. Sets the constraint's
    reasoning_end in place."""
    parser, so = state.reasoning_parser, params.structured_outputs
    if parser is None:
        return None
    if so is None or (mode.kind == "auto" and structured_from_request(req)[0] is None):
        return parser
    if state.reasoning_end_token() is None or not thinks_first(prompt):
        return None
    so.reasoning_end = END
    return "deepseek_r1"


def chat_logprobs_obj(lps: list[TokenLogprobs] | None, text: TokenText) -> ChoiceLogprobs | None:
    if lps is None:
        return None

    def top(token_id: int, logprob: float) -> TopLogprob:
        t = text(token_id)
        return TopLogprob(token=text.label(token_id), logprob=logprob, bytes=list(t.encode("utf-8")))

    content = []
    for lp in lps:
        chosen = top(lp.chosen.token_id, lp.chosen.logprob)
        content.append(TokenLogprob(**chosen.model_dump(),
                                    top_logprobs=[top(a.token_id, a.logprob) for a in lp.top]))
    return ChoiceLogprobs(content=content)


def _usage(state: ServerState, prep: PreparedChat, ro: RequestOutput) -> UsageInfo:
    prompt_len = len(prep.prompt_ids)
    completion = sum(len(c.token_ids) for c in ro.outputs)
    details = None
    if prep.reasoning is not None:
        details = {"reasoning_tokens": sum(reasoning_tokens(state, prep, c) for c in ro.outputs)}
    return UsageInfo(prompt_tokens=prompt_len, completion_tokens=completion,
                     total_tokens=prompt_len + completion,
                     prompt_tokens_details={"cached_tokens": ro.num_cached_tokens},
                     completion_tokens_details=details)


def reasoning_tokens(state: ServerState, prep: PreparedChat, c: CompletionOutput) -> int:
    """The output tokens of `c`'s thinking, its closing tag included: all of them when
    the thinking never ended; 0 without thinking."""
    if split_thinking(prep, c.text)[0] is None:
        return 0
    end = c.text.find(END)
    if end < 0:
        return len(c.token_ids)
    end_id = state.reasoning_end_token()
    if end_id is not None and end_id in c.token_ids:
        return c.token_ids.index(end_id) + 1
    # the tag is plain text in this vocabulary: the shortest prefix of the output whose
    # text holds it (a search over prefix lengths, each decoded)
    lo, hi = 1, len(c.token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if END in state.tokenizer.decode(c.token_ids[:mid], skip_special_tokens=True):
            hi = mid
        else:
            lo = mid + 1
    return lo


def split_thinking(prep: PreparedChat, text: str) -> tuple[str | None, str | None]:
    """A whole output as (reasoning, the rest) under the request's reasoning parser;
    (None, text) without one."""
    if prep.reasoning is None:
        return None, text
    return split_reasoning(prep.reasoning, prep.prompt, text)


def output_verdict(prep: PreparedChat, c: CompletionOutput, metrics: Metrics) -> Verdict | None:
    """Re-validates a finished choice (gateway/output_check.py) and counts the result;
    a constraint that applied after the thinking checks what follows it."""
    so, text = prep.params.structured_outputs, c.text
    if so is not None and so.reasoning_end is not None:
        text = split_thinking(prep, text)[1] or ""
    verdict = check_output(so, prep.mode, text, c.finish_reason, c.stop_reason)
    if verdict is not None:
        metrics.observe_constrained(verdict.result)
    return verdict


def _choice(c: CompletionOutput, prep: PreparedChat, text: TokenText,
            verdict: Verdict | None = None) -> ChatChoice:
    mode = prep.mode
    thinking, body = split_thinking(prep, c.text)
    thinking = thinking if prep.include_reasoning else None
    content, calls = parse_tool_output(mode, body or "")
    if body is None and not calls:
        content = None
    message = ResponseMessage(content=content, tool_calls=calls or None, reasoning=thinking,
                              reasoning_content=thinking)
    finish = finish_reason_with_tools(c.finish_reason, len(calls), mode, c.stop_reason)
    if prep.legacy_functions and calls:        # one call at most (parallel_tool_calls off)
        message.tool_calls, message.function_call = None, calls[0].function
        finish = "function_call" if finish == "tool_calls" else finish
    return ChatChoice(index=c.index, message=message,
                      logprobs=chat_logprobs_obj(c.logprobs, text),
                      finish_reason=finish,
                      stop_reason=c.stop_reason,
                      token_ids=list(c.token_ids) if prep.token_ids else None,
                      formwork=verdict.field() if verdict is not None else None)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request):
    timer = RequestTimer()
    prep = await prepare_chat(state, req)
    request_id = random_id("chatcmpl-")
    log_request(state, request_id, prep.prompt, prep.params)
    if req.use_beam_search:
        return await _beam_chat(state, req, prep, request_id, raw)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage) \
            or state.options.force_include_usage
        continuous = include_usage and bool(req.stream_options
                                            and req.stream_options.continuous_usage_stats)
        try:
            outs = await primed(stream_outputs(state, request_id, prep.prompt, prep.prompt_ids,
                                               prep.params, timer), raw)
        except APIError as e:
            raise blame(e, prep.source) from None
        return StreamingResponse(_chat_stream(state, prep, request_id, outs, include_usage,
                                              continuous),
                                 media_type="text/event-stream")
    try:
        final = await run_until_disconnect(
            generate_final(state, request_id, prep.prompt, prep.prompt_ids, prep.params, timer), raw)
    except APIError as e:
        raise blame(e, prep.source) from None
    text = TokenText(state.tokenizer, prep.token_ids_as_names)
    choices = [_choice(c, prep, text, output_verdict(prep, c, state.metrics))
               for c in final.outputs]
    resp = ChatCompletionResponse(id=request_id, model=prep.model, choices=choices,
                                  usage=_usage(state, prep, final),
                                  prompt_logprobs=prompt_logprobs_field(final.prompt_logprobs))
    return JSONResponse(_response_json(resp, prep))


def _response_json(resp: ChatCompletionResponse, prep: PreparedChat) -> dict:
    """The response as JSON; vLLM's prompt_token_ids where return_token_ids asks, and
    no null extension keys."""
    if prep.token_ids:
        resp.prompt_token_ids = list(prep.prompt_ids)
    data = resp.model_dump(mode="json")
    drop_unset(data["choices"])
    drop_unset([data])
    return data


async def _beam_chat(state: ServerState, req: ChatCompletionRequest, prep: PreparedChat,
                     request_id: str, raw: Request) -> JSONResponse:
    """use_beam_search: the n best beams, best first, as the choices."""
    out = await run_until_disconnect(serve_beam_search(
        state, request_id, prep.prompt_ids, req.n, prep.params.max_tokens,
        ignore_eos=req.ignore_eos, temperature=req.temperature or 0.0,
        length_penalty=req.length_penalty), raw)
    choices = [ChatChoice(index=j, message=ResponseMessage(content=seq.text),
                          finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                          token_ids=list(seq.generated) if prep.token_ids else None)
               for j, seq in enumerate(out.sequences)]
    done = sum(len(seq.generated) for seq in out.sequences)
    resp = ChatCompletionResponse(id=request_id, model=prep.model, choices=choices,
                                  usage=UsageInfo(prompt_tokens=len(prep.prompt_ids),
                                                  completion_tokens=done,
                                                  total_tokens=len(prep.prompt_ids) + done))
    return JSONResponse(_response_json(resp, prep))


def _chunk(request_id: str, created: int, model: str, choice: ChatStreamChoice | None,
           include_usage: bool, usage: UsageInfo | None = None,
           prompt_ids: list[int] | None = None) -> str:
    chunk = ChatCompletionChunk(id=request_id, created=created, model=model,
                                choices=[choice] if choice is not None else [], usage=usage,
                                prompt_token_ids=prompt_ids)
    data = chunk.model_dump(mode="json")
    for c, model_choice in zip(data["choices"], chunk.choices):
        c["delta"] = model_choice.delta.model_dump(mode="json", exclude_none=True)
        if model_choice.logprobs is None:
            c["logprobs"] = None
        if model_choice.finish_reason is None:
            del c["stop_reason"]
    drop_unset(data["choices"])
    drop_unset([data])
    if not include_usage:
        data.pop("usage")
    return sse(data)


async def _chat_stream(state: ServerState, prep: PreparedChat, request_id: str,
                       outputs: AsyncIterator[RequestOutput], include_usage: bool,
                       continuous: bool = False) -> AsyncIterator[str]:
    """The events of `outputs` (`primed`: the first already there). `continuous`:
    vLLM's continuous_usage_stats, each chunk with its choice's usage."""
    created, model = int(time.time()), prep.model
    prompt_len = len(prep.prompt_ids)

    def so_far(done: int) -> UsageInfo | None:
        return UsageInfo(prompt_tokens=prompt_len, completion_tokens=done,
                         total_tokens=prompt_len + done) if continuous else None

    text = TokenText(state.tokenizer, prep.token_ids_as_names)
    parsers = [ToolStreamParser(prep.mode) for _ in range(prep.params.n)]
    thinkers = [ReasoningSplitter(prep.reasoning, prep.prompt) if prep.reasoning else None
                for _ in range(prep.params.n)]
    for i in range(prep.params.n):
        yield _chunk(request_id, created, model, ChatStreamChoice(
            index=i, delta=DeltaMessage(role="assistant", content="")), include_usage,
            so_far(0), list(prep.prompt_ids) if prep.token_ids and i == 0 else None)
    last: RequestOutput | None = None
    sent_final = [False] * prep.params.n
    try:
        async with contextlib.aclosing(outputs) as outs:
            async for ro in outs:
                last = ro
                for c in ro.outputs:
                    if sent_final[c.index]:
                        continue
                    verdict = (output_verdict(prep, c, state.metrics)
                               if c.finish_reason is not None else None)
                    for piece in _choice_chunks(c, parsers[c.index], text, verdict,
                                                thinkers[c.index], prep.token_ids,
                                                prep.include_reasoning, prep.legacy_functions):
                        yield _chunk(request_id, created, model, piece, include_usage,
                                     so_far(len(c.token_ids)))
                    sent_final[c.index] = c.finish_reason is not None
    except APIError as e:
        yield sse_error(blame(e, prep.source))
        yield sse("[DONE]")
        return
    if include_usage and last is not None:
        yield _chunk(request_id, created, model, None, True, _usage(state, prep, last))
    yield sse("[DONE]")


def _choice_chunks(c: CompletionOutput, parser: ToolStreamParser, text: TokenText,
                   verdict: Verdict | None = None,
                   thinker: ReasoningSplitter | None = None,
                   token_ids: bool = False,
                   include_reasoning: bool = True,
                   legacy_functions: bool = False) -> list[ChatStreamChoice]:
    """The chunks of one completion's delta: reasoning / content / tool calls, then the
    finish chunk (carrying the `formwork` verdict of a constrained choice). With
    `token_ids` (return_token_ids) the first of them carries the delta's new token ids,
    in a chunk of its own where the delta shows nothing yet (text held back, a tool
    call still being parsed), so that the streamed ids add up to the output's."""
    thinking, body = ("", c.delta_text) if thinker is None else \
        thinker.step(c.delta_text, c.finish_reason is not None)
    thinking = thinking if include_reasoning else ""
    content, calls = parser.feed(body)
    if c.finish_reason is not None:
        tail_content, tail_calls = parser.finish()
        content = (content or "") + (tail_content or "") or None
        calls = calls + tail_calls
    pieces = []
    logprobs = chat_logprobs_obj(c.delta_logprobs, text)
    if content or calls or thinking or logprobs is not None:
        pieces.append(ChatStreamChoice(index=c.index, logprobs=logprobs, delta=DeltaMessage(
            content=content or None, reasoning=thinking or None,
            reasoning_content=thinking or None, tool_calls=calls or None)))
    if c.finish_reason is not None:
        reason = finish_reason_with_tools(c.finish_reason, parser.num_calls, parser.mode,
                                          c.stop_reason)
        pieces.append(ChatStreamChoice(index=c.index, delta=DeltaMessage(), finish_reason=reason,
                                       stop_reason=c.stop_reason,
                                       formwork=verdict.field() if verdict else None))
    if token_ids and c.delta_token_ids:
        if not pieces:
            pieces.append(ChatStreamChoice(index=c.index, delta=DeltaMessage()))
        pieces[0].token_ids = list(c.delta_token_ids)
    if legacy_functions:          # the deprecated `functions` API: its one call's pieces
        for piece in pieces:
            calls, piece.delta.tool_calls = piece.delta.tool_calls or [], None
            if calls and calls[0].function is not None:
                piece.delta.function_call = calls[0].function
            if piece.finish_reason == "tool_calls":
                piece.finish_reason = "function_call"
    return pieces

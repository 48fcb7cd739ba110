"""POST /v1/completions: one or more prompts -> choices (index = prompt_i * n + j).

As vLLM: `echo` with `logprobs` returns the prompt tokens' logprobs before the
generated ones (the first prompt token has none), `max_tokens=0` with `echo`
scores the prompt without generating, `prompt_logprobs` (extra field) returns
vLLM's per-position dicts, and `best_of` > n generates best_of candidates and
returns the n with the highest cumulative logprob (not with stream).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from formwork.gateway.beam_search import check_beam_request, serve_beam_search
from formwork.gateway.completion_logprobs import (completion_logprobs, echo_logprobs,
                                                  prompt_logprobs_field)
from formwork.gateway.errors import APIError, bad_request
from formwork.gateway.limits import check_text_fits, truncated_prompt
from formwork.gateway.metrics import Metrics, RequestTimer
from formwork.gateway.output_check import check_output, drop_unset, lark_grammars, prepare_lark
from formwork.gateway.output_processor import CompletionOutput, RequestOutput
from formwork.gateway.params import (check_max_logprobs, context_max_tokens,
                                     explicit_prompt_logprobs, log_request, sampling_params,
                                     structured_from_request, check_constraint,
                                     with_server_whitespace)
from formwork.gateway.serving import (ServerState, TokenText, blame, generate_final, primed,
                             run_until_disconnect, sse, sse_error, stream_outputs)
from formwork.schemas.openai import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from formwork.schemas.openai_base import random_id
from formwork.schemas.sampling import MAX_N, SamplingParams


@dataclass(slots=True)
class PreparedCompletion:
    model: str
    prompts: list[tuple[str | None, list[int]]]     # (text, token ids) per prompt
    params: list[SamplingParams]                      # per prompt (max_tokens may differ)
    source: str | None                                # request field of the constraint
    n: int = 1                                        # choices returned per prompt
    best_of: int = 1                                  # candidates generated per prompt (>= n)
    echo: bool = False
    logprobs: int | None = None                       # as asked (the engine may compute more)
    show_prompt_logprobs: bool = False                # `prompt_logprobs` field in the choices
    token_ids_as_names: bool = False                  # return_tokens_as_token_ids
    token_ids: bool = False                           # return_token_ids


def _prompts(tokenizer, state: ServerState, prompt, truncate: int | None = None,
             add_special_tokens: bool = True,
             side: str | None = None) -> list[tuple[str | None, list[int]]]:
    """Runs on a tokenizer worker thread (state.run_tokenizer): `tokenizer` is its own.
    `truncate`: vLLM's truncate_prompt_tokens (a cut prompt's text is its kept tokens');
    `add_special_tokens`: the tokenizer's BOS on text prompts, as vLLM's default."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt: must not be empty", param="prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            if truncate is None:       # a truncated prompt may be longer (the body limit holds)
                check_text_fits([p], state.max_model_len, state.max_token_chars, "prompt")
            ids = tokenizer(p, add_special_tokens=add_special_tokens).input_ids
            out.append((p, list(ids)))
        else:
            bad = next((t for t in p if not 0 <= t < len(tokenizer)), None)
            if bad is not None:
                raise bad_request(f"prompt: token id {bad} is out of range", param="prompt")
            out.append((tokenizer.decode(p), list(p)))
        if not out[-1][1]:
            raise bad_request("prompt: must not be empty", param="prompt")
        kept = truncated_prompt(out[-1][1], truncate, state.max_model_len, side)
        if len(kept) < len(out[-1][1]):
            out[-1] = (tokenizer.decode(kept), kept)
    return out


async def prepare_completion(state: ServerState, req: CompletionRequest) -> PreparedCompletion:
    """As prepare_chat: the constraint check in a thread, tokenizing on a tokenizer worker."""
    model = state.check_model(req.model)
    if req.suffix:
        raise bad_request("suffix: is not supported", param="suffix")
    best_of = req.n if req.best_of is None else req.best_of
    if best_of < req.n:
        raise bad_request(f"best_of: must be >= n ({req.n}), got {best_of}", param="best_of")
    if req.best_of is not None and best_of > MAX_N:      # (n itself: SamplingParams)
        raise bad_request(f"best_of: must be <= {MAX_N}, got {best_of}", param="best_of")
    if best_of > req.n and req.stream:
        raise bad_request("best_of: cannot be used with stream (the best candidates are known "
                          "only at the end); drop best_of or stream", param="best_of")
    shown_plp = explicit_prompt_logprobs(req)
    if shown_plp is None and req.echo:
        shown_plp = req.logprobs              # echo + logprobs scores the prompt (vLLM)
    engine_plp = shown_plp
    if engine_plp is None and req.echo and req.max_tokens == 0:
        engine_plp = 0                        # echo only: the engine runs max_tokens=0 as scoring
    # best_of ranks candidates by cumulative logprob: the chosen tokens' logprobs are needed
    engine_lp = req.logprobs if req.logprobs is not None or best_of == req.n else 0
    structured, source = structured_from_request(req)
    structured = with_server_whitespace(req, structured, state.options.structured_whitespace)
    if req.use_beam_search:
        check_beam_request(req, source, chat=False)
    if structured is not None:
        await check_constraint(state.constraints, structured, source,
                                state.engine.config.structured_backend)
        if grammars := lark_grammars(structured, None):      # the output check's parsers
            await asyncio.to_thread(prepare_lark, grammars)
    prompts = await state.run_tokenizer(_prompts, state, req.prompt, req.truncate_prompt_tokens,
                                        req.add_special_tokens, req.truncation_side)
    params = [sampling_params(req, max_tokens=context_max_tokens(
                  len(ids), req.max_tokens, state.max_model_len, "prompt",
                  state.default_sampling.get("max_tokens")),
                  logprobs=engine_lp, prompt_logprobs=engine_plp, structured=structured,
                  vocab_size=len(state.tokenizer),
                  scheduling_policy=state.scheduling_policy, tokenizer=state.tokenizer,
                  defaults=state.default_sampling,
                             extra_stop_ids=state.extra_stop_ids)
              for _, ids in prompts]
    for p in params:
        check_max_logprobs(p, state.options.max_logprobs, "logprobs")
    if best_of != req.n:
        params = [p.clone(n=best_of) for p in params]
    return PreparedCompletion(model, prompts, params, source, req.n, best_of, req.echo,
                              req.logprobs, shown_plp is not None,
                              req.return_tokens_as_token_ids
                              or state.options.return_tokens_as_token_ids, req.return_token_ids)


def _usage(prep: PreparedCompletion, finals: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(ids) for _, ids in prep.prompts)
    completion = sum(len(c.token_ids) for ro in finals for c in ro.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details={"cached_tokens": sum(ro.num_cached_tokens
                                                                 for ro in finals)})


def _best(prep: PreparedCompletion, outputs: list[CompletionOutput]) -> list[CompletionOutput]:
    """best_of: the n candidates with the highest cumulative logprob, best first."""
    if prep.best_of == prep.n:
        return outputs
    return sorted(outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:prep.n]


def _verdict_field(prep: PreparedCompletion, i: int, c: CompletionOutput, metrics: Metrics):
    """The `formwork` field of a finished choice (None: unconstrained); counted."""
    verdict = check_output(prep.params[i].structured_outputs, None, c.text, c.finish_reason,
                           c.stop_reason)
    if verdict is None:
        return None
    metrics.observe_constrained(verdict.result)
    return verdict.field()


def _choices(prep: PreparedCompletion, i: int, ro: RequestOutput,
             text: TokenText, metrics: Metrics) -> list[CompletionChoice]:
    prompt_text, prompt_ids = prep.prompts[i]
    prefix = (prompt_text or "") if prep.echo else ""
    plp_field = prompt_logprobs_field(ro.prompt_logprobs) if prep.show_prompt_logprobs else None
    choices = []
    for j, c in enumerate(_best(prep, ro.outputs)):
        lp = None
        if prep.logprobs is not None:
            head = echo_logprobs(prompt_ids, ro.prompt_logprobs, text) if prep.echo else None
            lp = completion_logprobs(c.logprobs, text, len(prefix), head)
        choices.append(CompletionChoice(
            index=i * prep.n + j, text=prefix + c.text, logprobs=lp,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason, prompt_logprobs=plp_field,
            token_ids=list(c.token_ids) if prep.token_ids else None,
            prompt_token_ids=list(prompt_ids) if prep.token_ids else None,
            formwork=_verdict_field(prep, i, c, metrics)))
    return choices


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request):
    prep = await prepare_completion(state, req)
    request_id = random_id("cmpl-")
    for i, (text, _) in enumerate(prep.prompts):
        log_request(state, f"{request_id}-{i}", text, prep.params[i])
    if req.use_beam_search:
        return await _beam_completion(state, req, prep, request_id, raw)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage) \
            or state.options.force_include_usage
        continuous = include_usage and bool(req.stream_options
                                            and req.stream_options.continuous_usage_stats)
        try:
            merged = await primed(_merged(state, prep, request_id), raw)
        except APIError as e:
            raise blame(e, prep.source) from None
        return StreamingResponse(_stream(state, prep, merged, request_id, req.echo,
                                         include_usage, continuous),
                                 media_type="text/event-stream")
    runs = [generate_final(state, f"{request_id}-{i}", p, ids, prep.params[i], RequestTimer())
            for i, (p, ids) in enumerate(prep.prompts)]
    try:
        finals = await run_until_disconnect(asyncio.gather(*runs), raw)
    except APIError as e:
        raise blame(e, prep.source) from None
    text = TokenText(state.tokenizer, prep.token_ids_as_names)
    choices = [c for i, ro in enumerate(finals)
               for c in _choices(prep, i, ro, text, state.metrics)]
    resp = CompletionResponse(id=request_id, model=prep.model, choices=choices,
                              usage=_usage(prep, finals))
    data = resp.model_dump(mode="json")
    drop_unset(data["choices"])
    return JSONResponse(data)


async def _beam_completion(state: ServerState, req: CompletionRequest, prep: PreparedCompletion,
                           request_id: str, raw: Request) -> JSONResponse:
    """use_beam_search: the n best beams of each prompt, best first."""
    runs = [serve_beam_search(state, f"{request_id}-{i}", ids, req.n, prep.params[i].max_tokens,
                              ignore_eos=req.ignore_eos, temperature=req.temperature or 0.0,
                              length_penalty=req.length_penalty)
            for i, (_, ids) in enumerate(prep.prompts)]
    results = await run_until_disconnect(asyncio.gather(*runs), raw)
    choices = [CompletionChoice(index=i * req.n + j, text=seq.text,
                                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                                token_ids=list(seq.generated) if prep.token_ids else None,
                                prompt_token_ids=list(prep.prompts[i][1]) if prep.token_ids
                                else None)
               for i, out in enumerate(results) for j, seq in enumerate(out.sequences)]
    prompt = sum(len(ids) for _, ids in prep.prompts)
    done = sum(len(seq.generated) for out in results for seq in out.sequences)
    resp = CompletionResponse(id=request_id, model=prep.model, choices=choices, usage=UsageInfo(
        prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done))
    data = resp.model_dump(mode="json")
    drop_unset(data["choices"])
    return JSONResponse(data)


async def _merged(state: ServerState, prep: PreparedCompletion,
                  request_id: str) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the streams of all prompts; cancelling the consumer aborts them all."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            text, ids = prep.prompts[i]
            async with contextlib.aclosing(stream_outputs(
                    state, f"{request_id}-{i}", text, ids, prep.params[i], RequestTimer())) as s:
                async for ro in s:
                    q.put_nowait((i, ro))
        except Exception as e:
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(prep.prompts))]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _ChoiceDeltas:
    """Per streamed choice: the text sent so far (logprob offsets) and whether the
    prompt was echoed; turns one engine output into its chunk's choice."""

    def __init__(self, state: ServerState, prep: PreparedCompletion, echo: bool):
        self.state, self.prep, self.echo = state, prep, echo
        self.text = TokenText(state.tokenizer, prep.token_ids_as_names)
        self.echoed: set[int] = set()
        self.started: set[int] = set()      # choices whose first chunk was sent
        self.finished: set[int] = set()     # choices whose finish chunk was sent
        self.offsets: dict[int, int] = {}

    def choice(self, i: int, ro: RequestOutput, c) -> dict | None:
        """The choice for output `c` of prompt `i`, or None when there is nothing to send
        (a choice that has finished is in each later output of its prompt, as the
        output processor snapshots all of a request's choices)."""
        prep, idx = self.prep, i * self.prep.n + c.index
        if idx in self.finished:
            return None
        delta, head, start = c.delta_text, None, self.offsets.get(idx, 0)
        if self.echo and idx not in self.echoed:
            self.echoed.add(idx)
            prompt_text, prompt_ids = prep.prompts[i]
            delta = (prompt_text or "") + delta
            start += len(prompt_text or "")
            if prep.logprobs is not None:
                head = echo_logprobs(prompt_ids, ro.prompt_logprobs, self.text)
        if not delta and c.finish_reason is None and not c.delta_token_ids:
            return None
        lp = completion_logprobs(c.delta_logprobs, self.text, start, head)
        self.offsets[idx] = self.offsets.get(idx, 0) + len(delta)
        choice = {"index": idx, "text": delta,
                  "logprobs": lp.model_dump(mode="json") if lp else None,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if prep.token_ids:              # vLLM's: the prompt's ids in a choice's first chunk
            if idx not in self.started:
                choice["prompt_token_ids"] = list(prep.prompts[i][1])
            choice["token_ids"] = list(c.delta_token_ids)
        self.started.add(idx)
        if c.finish_reason is not None:
            self.finished.add(idx)
        if c.finish_reason is not None and \
                (check := _verdict_field(prep, i, c, self.state.metrics)) is not None:
            choice["formwork"] = check.model_dump(mode="json")
        return choice


async def _stream(state: ServerState, prep: PreparedCompletion,
                  outputs: AsyncIterator[tuple[int, RequestOutput]], request_id: str, echo: bool,
                  include_usage: bool, continuous: bool = False) -> AsyncIterator[str]:
    """The events of `outputs` (`primed`: the first already there). `continuous`:
    vLLM's continuous_usage_stats, each chunk with its choice's usage (its prompt's
    tokens and its own so far)."""
    created, deltas = int(time.time()), _ChoiceDeltas(state, prep, echo)
    finals: dict[int, RequestOutput] = {}

    def chunk(choices: list[dict], usage: UsageInfo | None = None) -> str:
        data = {"id": request_id, "object": "text_completion", "created": created,
                "model": prep.model, "choices": choices}
        if include_usage:
            data["usage"] = usage.model_dump(mode="json") if usage else None
        return sse(data)

    try:
        async with contextlib.aclosing(outputs) as merged:
            async for i, ro in merged:
                for c in ro.outputs:
                    if (choice := deltas.choice(i, ro, c)) is not None:
                        plen = len(prep.prompts[i][1])
                        yield chunk([choice], UsageInfo(
                            prompt_tokens=plen, completion_tokens=len(c.token_ids),
                            total_tokens=plen + len(c.token_ids)) if continuous else None)
                if ro.finished:
                    finals[i] = ro
    except APIError as e:
        yield sse_error(blame(e, prep.source))
        yield sse("[DONE]")
        return
    if include_usage:
        yield chunk([], _usage(prep, [finals[i] for i in sorted(finals)]))
    yield sse("[DONE]")

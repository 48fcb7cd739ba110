"""POST /v1/completions: one or more prompts -> choices (index = prompt_i * n + j)."""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.errors import APIError, bad_request
from gateway.metrics import RequestTimer
from gateway.output_processor import CompletionOutput, RequestOutput
from gateway.params import (context_max_tokens, sampling_params, structured_from_request,
                            validate_constraint)
from gateway.serving import (ServerState, TokenText, blame, generate_final,
                             run_until_disconnect, sse, sse_error, stream_outputs)
from schemas.engine import TokenLogprobs
from schemas.openai import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                            CompletionResponse, UsageInfo, random_id)
from schemas.sampling import SamplingParams


@dataclass(slots=True)
class PreparedCompletion:
    model: str
    prompts: list[tuple[str | None, list[int]]]     # (text, token ids) per prompt
    params: list[SamplingParams]                      # per prompt (max_tokens may differ)
    source: str | None                                # request field of the constraint


def _prompts(state: ServerState, prompt) -> list[tuple[str | None, list[int]]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt: must not be empty", param="prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            ids = state.tokenizer(p, add_special_tokens=False).input_ids
            out.append((p, list(ids)))
        else:
            bad = next((t for t in p if not 0 <= t < len(state.tokenizer)), None)
            if bad is not None:
                raise bad_request(f"prompt: token id {bad} is out of range", param="prompt")
            out.append((state.tokenizer.decode(p), list(p)))
        if not out[-1][1]:
            raise bad_request("prompt: must not be empty", param="prompt")
    return out


async def prepare_completion(state: ServerState, req: CompletionRequest) -> PreparedCompletion:
    """As prepare_chat: the constraint check in a thread, the tokenizer on this one."""
    model = state.check_model(req.model)
    if req.suffix:
        raise bad_request("suffix: is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of: only best_of == n is supported", param="best_of")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo: prompt logprobs are not supported; drop echo or logprobs",
                          param="echo")
    structured, source = structured_from_request(req)
    if structured is not None:
        await asyncio.to_thread(validate_constraint, structured, source,
                                state.engine.config.structured_backend)
    prompts = _prompts(state, req.prompt)
    params = [sampling_params(req, max_tokens=context_max_tokens(
                  len(ids), req.max_tokens, state.max_model_len, "prompt"),
                  logprobs=req.logprobs, structured=structured) for _, ids in prompts]
    return PreparedCompletion(model, prompts, params, source)


def completion_logprobs(lps: list[TokenLogprobs] | None, text: TokenText,
                        offset: int) -> CompletionLogprobs | None:
    if lps is None:
        return None
    out = CompletionLogprobs()
    for lp in lps:
        token = text(lp.chosen.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(lp.chosen.logprob)
        out.top_logprobs.append({text(a.token_id): a.logprob for a in lp.top} or None)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def _usage(prep: PreparedCompletion, finals: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(ids) for _, ids in prep.prompts)
    completion = sum(len(c.token_ids) for ro in finals for c in ro.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)


def _choice(i: int, n: int, c: CompletionOutput, echo: str | None, text: TokenText):
    prefix = echo or ""
    return CompletionChoice(index=i * n + c.index, text=prefix + c.text,
                            logprobs=completion_logprobs(c.logprobs, text, len(prefix)),
                            finish_reason=c.finish_reason, stop_reason=c.stop_reason)


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request):
    prep = await prepare_completion(state, req)
    request_id = random_id("cmpl-")
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(state, prep, request_id, req.echo, include_usage),
                                 media_type="text/event-stream")
    runs = [generate_final(state, f"{request_id}-{i}", p, ids, prep.params[i], RequestTimer())
            for i, (p, ids) in enumerate(prep.prompts)]
    try:
        finals = await run_until_disconnect(asyncio.gather(*runs), raw)
    except APIError as e:
        raise blame(e, prep.source) from None
    text, n = TokenText(state.tokenizer), req.n
    choices = [_choice(i, n, c, prep.prompts[i][0] if req.echo else None, text)
               for i, ro in enumerate(finals) for c in ro.outputs]
    resp = CompletionResponse(id=request_id, model=prep.model, choices=choices,
                              usage=_usage(prep, finals))
    return JSONResponse(resp.model_dump(mode="json"))


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


async def _stream(state: ServerState, prep: PreparedCompletion, request_id: str, echo: bool,
                  include_usage: bool) -> AsyncIterator[str]:
    created, n, text = int(time.time()), prep.params[0].n, TokenText(state.tokenizer)
    finals: dict[int, RequestOutput] = {}
    echoed: set[int] = set()
    offsets: dict[int, int] = {}

    def chunk(choices: list[dict], usage: UsageInfo | None = None) -> str:
        data = {"id": request_id, "object": "text_completion", "created": created,
                "model": prep.model, "choices": choices}
        if include_usage:
            data["usage"] = usage.model_dump(mode="json") if usage else None
        return sse(data)

    try:
        async with contextlib.aclosing(_merged(state, prep, request_id)) as merged:
            async for i, ro in merged:
                for c in ro.outputs:
                    idx = i * n + c.index
                    delta = c.delta_text
                    if echo and idx not in echoed:
                        echoed.add(idx)
                        delta = (prep.prompts[i][0] or "") + delta
                    if not delta and c.finish_reason is None and not c.delta_token_ids:
                        continue
                    lp = completion_logprobs(c.delta_logprobs, text, offsets.get(idx, 0))
                    offsets[idx] = offsets.get(idx, 0) + len(delta)
                    yield chunk([{"index": idx, "text": delta,
                                  "logprobs": lp.model_dump(mode="json") if lp else None,
                                  "finish_reason": c.finish_reason,
                                  "stop_reason": c.stop_reason}])
                if ro.finished:
                    finals[i] = ro
    except APIError as e:
        yield sse_error(blame(e, prep.source))
        yield sse("[DONE]")
        return
    if include_usage:
        yield chunk([], _usage(prep, [finals[i] for i in sorted(finals)]))
    yield sse("[DONE]")

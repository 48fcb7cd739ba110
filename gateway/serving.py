"""What the chat and completions handlers share: server state, model check,
token text for logprobs, SSE framing, and cancellation on client disconnect."""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request

from formwork.gateway.constraint_check import ConstraintChecker
from formwork.gateway.dp_client import DPEngineClient
from formwork.gateway.engine_client import EngineClient, EngineRequestError
from formwork.gateway.errors import APIError
from formwork.gateway.json_lines import dumps_line
from formwork.gateway.metrics import Metrics, RequestTimer
from formwork.gateway.output_processor import RequestOutput
from formwork.gateway.reasoning import END
from formwork.gateway.serve_options import RequestOptions
from formwork.gateway.tokenizer_pool import TokenizerPool
from formwork.gateway.tools import TOOL_FORMATS, ToolFormat
from formwork.schemas.sampling import SamplingParams
from formwork.schemas.structured import reasoning_end_id

T = TypeVar("T")


@dataclass(slots=True)
class ServerState:
    engine: EngineClient | DPEngineClient       # the latter under data parallelism
    tokenizer: Any
    served_model_names: tuple[str, ...]
    max_model_len: int
    metrics: Metrics
    api_key: str | None = None
    max_token_chars: int = 1 << 30      # the tokenizer's longest token (gateway/limits.py)
    # chat templating / tokenizing off the event loop; None: inline (unit tests' apps)
    tokenizers: TokenizerPool | None = None
    # constraints checked in a worker process; None: on a thread (unit tests' apps)
    constraints: ConstraintChecker | None = None
    scheduling_policy: str = "fcfs"     # the engines' (a request's priority needs "priority")
    reasoning_parser: str | None = None   # vLLM's --reasoning-parser (gateway/reasoning.py)
    options: RequestOptions = field(default_factory=RequestOptions)   # gateway/serve_options.py
    default_sampling: dict = field(default_factory=dict)   # for fields a request leaves out
    # the generation config's end ids beside the tokenizer's: stop ids of every request
    extra_stop_ids: tuple[int, ...] = ()
    _reasoning_end: list = field(default_factory=list, repr=False)   # reasoning_end_token's

    @property
    def tool_format(self) -> ToolFormat:
        """How tool calls are written in free text (--tool-call-parser)."""
        return TOOL_FORMATS[self.options.tool_call_parser]

    def reasoning_end_token(self) -> int | None:
        """The id of `</think>` when the tokenizer writes it as one token (asked once)."""
        if not self._reasoning_end:
            self._reasoning_end.append(reasoning_end_id(self.tokenizer, END))
        return self._reasoning_end[0]

    async def run_tokenizer(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(tokenizer, *args)` on a tokenizer worker thread (its own tokenizer copy);
        inline with `self.tokenizer` when there is no pool."""
        if self.tokenizers is None:
            return fn(self.tokenizer, *args, **kwargs)
        return await self.tokenizers.run(fn, *args, **kwargs)

    def check_model(self, model: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if model is None or model in self.served_model_names:
            return model or self.served_model_names[0]
        raise APIError(404, f"The model `{model}` does not exist. This server serves: "
                       f"{', '.join(self.served_model_names)}.",
                       type="invalid_request_error", param="model", code="model_not_found")


class TokenText:
    """Token id -> its text (cached), for logprobs; `label` names a token in them:
    its text, or "token_id:<id>" under vLLM's return_tokens_as_token_ids (`as_ids`)."""

    def __init__(self, tokenizer, as_ids: bool = False) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}
        self._as_ids = as_ids

    def label(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._as_ids else self(token_id)

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def blame(err: APIError, source: str | None) -> APIError:
    """An engine-side failure of a constrained request without a param names the
    constraint's field (the grammar failed to compile in the engine)."""
    if isinstance(err, EngineRequestError) and err.param is None and source is not None:
        return EngineRequestError(f"{source}: {err.message}", param=source)
    return err


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else dumps_line(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def sse_error(err: APIError) -> str:
    return sse({"error": {"message": err.message, "type": err.type, "param": err.param,
                          "code": err.code}})


async def run_until_disconnect(coro: Awaitable[T], request: Request) -> T:
    """Await `coro`, cancelling it (so the engine request is aborted) if the client leaves."""
    task = asyncio.ensure_future(coro)

    async def listen() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(listen())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise APIError(499, "client disconnected", type="client_closed_request")
    return task.result()


async def primed(outputs: AsyncIterator[T], request: Request) -> AsyncIterator[T]:
    """`outputs` with its first item already awaited, before a stream's response
    starts: an error the engine gives before any output (a grammar that failed to
    compile or timed out, a constraint only the real vocabulary refuses, no engine)
    is then the request's HTTP status (APIError raised here, and `outputs` closed),
    not a 200 and an error event. The headers go out with the first token, which
    costs a client nothing it could see: no event could come before it. A client
    that leaves meanwhile aborts the request (APIError 499)."""
    async def first() -> tuple[bool, T | None]:
        try:
            return True, await anext(outputs)
        except StopAsyncIteration:
            return False, None
    try:
        got, item = await run_until_disconnect(first(), request)
    except BaseException:
        await outputs.aclose()
        raise

    async def rest() -> AsyncIterator[T]:
        try:
            if got:
                yield item
                async for x in outputs:
                    yield x
        finally:
            await outputs.aclose()
    return rest()


async def stream_outputs(state: ServerState, request_id: str, prompt: str | None,
                         prompt_ids: list[int], params: SamplingParams,
                         timer: RequestTimer) -> AsyncIterator[RequestOutput]:
    """Run one request, yielding every RequestOutput; closing it aborts the request.
    Records its metrics (also when cut short)."""
    last: RequestOutput | None = None
    try:
        async with contextlib.aclosing(
                state.engine.generate(request_id, prompt, prompt_ids, params)) as gen:
            async for ro in gen:
                timer.on_tokens(sum(len(c.delta_token_ids) for c in ro.outputs))
                last = ro
                yield ro
    finally:
        reasons = ([c.finish_reason for c in last.outputs] if last is not None and last.finished
                   else ["abort"] * params.n)
        state.metrics.observe_finished(timer, len(prompt_ids), reasons)


async def generate_final(state: ServerState, request_id: str, prompt: str | None,
                         prompt_ids: list[int], params: SamplingParams,
                         timer: RequestTimer) -> RequestOutput:
    """`stream_outputs` run to completion: its last (finished) RequestOutput."""
    final: RequestOutput | None = None
    async with contextlib.aclosing(
            stream_outputs(state, request_id, prompt, prompt_ids, params, timer)) as outputs:
        async for final in outputs:
            pass
    assert final is not None and final.finished
    return final

"""POST /v1/responses (OpenAI's Responses API) on the chat-completions path.

The request becomes a chat request (gateway/responses_input.py), `prepare_chat`
validates it and builds the prompt, SamplingParams and output constraint as for
/v1/chat/completions; the output is shaped as a `response` object: a `message`
item (one output_text part) and/or `function_call` items, after a `reasoning`
item (one reasoning_text part) when a `--reasoning-parser` split off the model's
thinking. A response cut by
max_output_tokens is "incomplete" (incomplete_details.reason "max_output_tokens").
Streaming sends OpenAI's typed events (`event: <type>` + data with `type` and
`sequence_number`), ending with response.completed (response.incomplete when cut).
"""
from __future__ import annotations

import contextlib
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from formwork.gateway.errors import APIError
from formwork.gateway.json_lines import dumps_line
from formwork.gateway.metrics import RequestTimer
from formwork.gateway.output_processor import RequestOutput
from formwork.gateway.reasoning import ReasoningSplitter
from formwork.gateway.responses_input import (chat_request, check_supported, input_messages,
                                              responses_error, truncation_starts)
from formwork.gateway.responses_store import ResponseStore, StoredResponse
from formwork.gateway.serving import (ServerState, TokenText, blame, generate_final, primed,
                                      run_until_disconnect, stream_outputs)
from formwork.gateway.serving_chat import (PreparedChat, chat_logprobs_obj, prepare_chat,
                                           reasoning_tokens, split_thinking)
from formwork.gateway.tool_parser import ToolStreamParser, parse_tool_output
from formwork.schemas.openai import ToolCall
from formwork.schemas.responses import (CustomToolCallItem, FunctionCallItem, IncompleteDetails,
                                        OutputItem,
                                        OutputMessage, OutputText, ReasoningItem, ReasoningText,
                                        ResponseObject, ResponsesRequest, ResponseUsage)


def _base(req: ResponsesRequest, model: str) -> ResponseObject:
    """The response object before any output: the request's options echoed."""
    return ResponseObject(
        model=model, instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls,
        previous_response_id=req.previous_response_id, store=req.store,
        temperature=req.temperature, top_p=req.top_p,
        text=req.text if req.text and req.text.get("format") else {"format": {"type": "text"}},
        tool_choice=req.tool_choice or ("auto" if req.tools else "none"),
        tools=req.tools or [], user=req.user, metadata=req.metadata or {},
        reasoning=req.reasoning, truncation=req.truncation or "disabled",
        top_logprobs=req.top_logprobs, max_tool_calls=req.max_tool_calls)


def _usage(state: ServerState, prep: PreparedChat, ro: RequestOutput) -> ResponseUsage:
    prompt_len = len(prep.prompt_ids)
    out = sum(len(c.token_ids) for c in ro.outputs)
    thinking = sum(reasoning_tokens(state, prep, c) for c in ro.outputs)
    return ResponseUsage(input_tokens=prompt_len, output_tokens=out, total_tokens=prompt_len + out,
                         input_tokens_details={"cached_tokens": ro.num_cached_tokens},
                         output_tokens_details={"reasoning_tokens": thinking})


def _logprobs(state: ServerState, prep: PreparedChat, lps) -> list[dict]:
    """output_text logprobs (chat's token entries) of `lps`, but for special tokens (the
    end of sequence): they are not in the text."""
    special = set(getattr(state.tokenizer, "all_special_ids", ()) or ())
    lps = [lp for lp in lps if lp.chosen.token_id not in special]
    obj = chat_logprobs_obj(lps, TokenText(state.tokenizer, prep.token_ids_as_names))
    return [] if obj is None else [e.model_dump(mode="json") for e in obj.content]


def _finish(resp: ResponseObject, items: list[OutputItem], finish_reason: str | None,
            usage: ResponseUsage) -> ResponseObject:
    cut = finish_reason == "length"
    return resp.model_copy(update={
        "output": items, "usage": usage, "status": "incomplete" if cut else "completed",
        "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None})


def output_items(content: str | None, calls: list[ToolCall], cut: bool,
                 reasoning: str | None = None) -> list[OutputItem]:
    """A reasoning item for the thinking (if any), a message item for the text (also an
    empty one when nothing else came), then one function_call item per call; when
    `cut`, the last item is "incomplete" (as streamed)."""
    items: list[OutputItem] = []
    if reasoning:
        items.append(ReasoningItem(content=[ReasoningText(text=reasoning)]))
    if content or not calls:
        items.append(OutputMessage(content=[OutputText(text=content or "")]))
    items += [CustomToolCallItem(call_id=c.id, name=c.custom.name, input=c.custom.input)
              if c.type == "custom" else
              FunctionCallItem(call_id=c.id, name=c.function.name, arguments=c.function.arguments)
              for c in calls]
    if cut:
        items[-1].status = "incomplete"
    return items


def assistant_message(items: list[OutputItem]) -> dict:
    """The output as one chat message, for the stored conversation."""
    text = "".join(p.text for i in items if isinstance(i, OutputMessage) for p in i.content)
    calls = [{"id": i.call_id, "type": "function",
              "function": {"name": i.name, "arguments": i.arguments}}
             if isinstance(i, FunctionCallItem) else
             {"id": i.call_id, "type": "custom", "custom": {"name": i.name, "input": i.input}}
             for i in items if isinstance(i, (FunctionCallItem, CustomToolCallItem))]
    return {"role": "assistant", "content": text or None} | ({"tool_calls": calls} if calls else {})


def _save(store: ResponseStore, req: ResponsesRequest, conversation: list[dict],
          resp: ResponseObject) -> None:
    if req.store:
        store.put(resp.id, StoredResponse(resp.model_dump(mode="json"),
                                          conversation + [assistant_message(resp.output)]))


async def create_response(state: ServerState, store: ResponseStore, req: ResponsesRequest,
                          raw: Request):
    check_supported(req)
    history = (store.get(req.previous_response_id).conversation
               if req.previous_response_id is not None else [])
    conversation = history + input_messages(req.input)
    prep = await _prepare(state, req, conversation)
    base, timer = _base(req, prep.model), RequestTimer()
    if req.stream:
        try:
            outs = await primed(stream_outputs(state, base.id, prep.prompt, prep.prompt_ids,
                                               prep.params, timer), raw)
        except APIError as e:
            raise responses_error(blame(e, prep.source)) from None
        events = _stream(state, store, req, prep, conversation, base, outs)
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        final = await run_until_disconnect(generate_final(
            state, base.id, prep.prompt, prep.prompt_ids, prep.params, timer), raw)
    except APIError as e:
        raise responses_error(blame(e, prep.source)) from None
    c = final.outputs[0]
    thinking, body = split_thinking(prep, c.text)
    thinking = thinking if prep.include_reasoning else None     # vLLM's include_reasoning
    content, calls = parse_tool_output(prep.mode, body or "")
    items = output_items(content, calls, c.finish_reason == "length", thinking)
    if c.logprobs is not None:          # the tokens after the thinking
        for item in items:
            if isinstance(item, OutputMessage):
                lps = c.logprobs[reasoning_tokens(state, prep, c):]
                item.content[0].logprobs = _logprobs(state, prep, lps)
    resp = _finish(base, items, c.finish_reason, _usage(state, prep, final))
    _save(store, req, conversation, resp)
    return JSONResponse(resp.model_dump(mode="json"))


async def _prepare(state: ServerState, req: ResponsesRequest,
                   conversation: list[dict]) -> PreparedChat:
    """The chat path's preparation of `conversation`; under `truncation: "auto"` a
    conversation too long for the context loses its first items (the fewest that make
    it fit: a search over the places it may start), as OpenAI's truncation does."""
    try:
        return await prepare_chat(state, chat_request(req, conversation))
    except APIError as e:
        if req.truncation != "auto" or e.code != "context_length_exceeded":
            raise responses_error(e) from None
        too_long = e
    starts, best = truncation_starts(conversation), None
    lo, hi = 0, len(starts) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            best = await prepare_chat(state, chat_request(req, conversation[starts[mid]:]))
            hi = mid - 1
        except APIError as e:
            if e.code != "context_length_exceeded":
                raise responses_error(e) from None
            lo = mid + 1
    if best is None:
        raise responses_error(too_long) from None
    return best


class EventWriter:
    """The typed SSE events of one streamed response; owns its output items, so the
    final response holds exactly the items (and ids) the events announced."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {dumps_line(data)}\n\n"

    def _added(self, item: OutputItem) -> list[str]:
        self.items.append(item)
        self.open = item
        shown = item.model_dump(mode="json") | {"status": "in_progress"}
        if isinstance(item, (OutputMessage, ReasoningItem)):
            shown["content"] = []
        out = [self.event("response.output_item.added", output_index=len(self.items) - 1,
                          item=shown)]
        if isinstance(item, (OutputMessage, ReasoningItem)):
            part = OutputText() if isinstance(item, OutputMessage) else ReasoningText()
            out.append(self.event("response.content_part.added", **self._where(),
                                  part=part.model_dump(mode="json")))
        return out

    def _where(self) -> dict:
        return {"item_id": self.open.id, "output_index": len(self.items) - 1, "content_index": 0}

    def text(self, delta: str, logprobs: list[dict] | None = None) -> list[str]:
        out = [] if isinstance(self.open, OutputMessage) else self.close("completed")
        if not isinstance(self.open, OutputMessage):
            out += self._added(OutputMessage(content=[OutputText()]))
        self.open.content[0].text += delta
        self.open.content[0].logprobs += logprobs or []
        return out + [self.event("response.output_text.delta", **self._where(), delta=delta,
                                 logprobs=logprobs or [])]

    def reasoning(self, delta: str) -> list[str]:
        out = [] if isinstance(self.open, ReasoningItem) else self.close("completed")
        if not isinstance(self.open, ReasoningItem):
            out += self._added(ReasoningItem(content=[ReasoningText()]))
        self.open.content[0].text += delta
        return out + [self.event("response.reasoning_text.delta", **self._where(), delta=delta)]

    def call(self, call_id: str, name: str, custom: bool = False) -> list[str]:
        item = CustomToolCallItem(call_id=call_id, name=name) if custom else \
            FunctionCallItem(call_id=call_id, name=name)
        return self.close("completed") + self._added(item)

    def arguments(self, delta: str) -> list[str]:
        """More of the open call's arguments (a custom tool's: its input)."""
        where = {k: v for k, v in self._where().items() if k != "content_index"}
        if isinstance(self.open, CustomToolCallItem):
            self.open.input += delta
            return [self.event("response.custom_tool_call_input.delta", **where, delta=delta)]
        assert isinstance(self.open, FunctionCallItem)
        self.open.arguments += delta
        return [self.event("response.function_call_arguments.delta", **where, delta=delta)]

    def close(self, status: str) -> list[str]:
        """Ends the open item (if any) with `status`."""
        item, out = self.open, []
        if item is None:
            return out
        item.status = status
        if isinstance(item, (OutputMessage, ReasoningItem)):
            part = item.content[0]
            if isinstance(item, OutputMessage):
                out.append(self.event("response.output_text.done", **self._where(),
                                      text=part.text, logprobs=part.logprobs))
            else:
                out.append(self.event("response.reasoning_text.done", **self._where(),
                                      text=part.text))
            out.append(self.event("response.content_part.done", **self._where(),
                                  part=part.model_dump(mode="json")))
        elif isinstance(item, CustomToolCallItem):
            where = {k: v for k, v in self._where().items() if k != "content_index"}
            out.append(self.event("response.custom_tool_call_input.done", **where,
                                  input=item.input))
        else:
            where = {k: v for k, v in self._where().items() if k != "content_index"}
            out.append(self.event("response.function_call_arguments.done", **where,
                                  arguments=item.arguments))
        out.append(self.event("response.output_item.done", output_index=len(self.items) - 1,
                              item=item.model_dump(mode="json")))
        self.open = None
        return out

    def ensure_output(self) -> list[str]:
        """An empty message item when no message or call was generated (as the
        non-streamed output)."""
        if any(not isinstance(i, ReasoningItem) for i in self.items):
            return []
        return self.close("completed") + self._added(OutputMessage(content=[OutputText()]))

    def feed(self, content: str | None, calls, logprobs: list[dict] | None = None) -> list[str]:
        """One parsed delta (ToolStreamParser's content and DeltaToolCalls) as events;
        `logprobs`: the output_text logprobs that go with its text."""
        out = self.text(content, logprobs) if content else []
        for d in calls:
            if d.custom is not None:
                if d.id is not None:
                    out += self.call(d.id, d.custom.name, custom=True)
                if d.custom.input:
                    out += self.arguments(d.custom.input)
                continue
            if d.id is not None:
                out += self.call(d.id, d.function.name)
            if d.function is not None and d.function.arguments:
                out += self.arguments(d.function.arguments)
        return out


async def _stream(state: ServerState, store: ResponseStore, req: ResponsesRequest,
                  prep: PreparedChat, conversation: list[dict], base: ResponseObject,
                  outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    """The events of `outputs` (`primed`: the first already there)."""
    w = EventWriter()
    shown = base.model_dump(mode="json")
    yield w.event("response.created", response=shown)
    yield w.event("response.in_progress", response=shown)
    parser, last = ToolStreamParser(prep.mode), None
    thinker = ReasoningSplitter(prep.reasoning, prep.prompt) if prep.reasoning else None
    pending: list = []          # token logprobs not yet sent with a text delta
    try:
        async with contextlib.aclosing(outputs) as outs:
            async for ro in outs:
                last, c = ro, ro.outputs[0]
                body, thinking = c.delta_text, None
                if thinker is not None:
                    thinking, body = thinker.step(body, c.finish_reason is not None)
                    for e in (w.reasoning(thinking) if thinking and prep.include_reasoning
                              else []):
                        yield e
                if c.delta_logprobs and not (thinking and not body):   # not the thinking's
                    pending += c.delta_logprobs
                parts = [parser.feed(body)] + ([parser.finish()] if c.finish_reason else [])
                for content, calls in parts:
                    lps = _logprobs(state, prep, pending) if content and pending else None
                    pending = [] if lps is not None else pending
                    for e in w.feed(content, calls, lps):
                        yield e
    except APIError as e:
        err = responses_error(blame(e, prep.source))
        yield w.event("error", code=err.code, message=err.message, param=err.param,
                      error={"message": err.message, "type": err.type, "param": err.param,
                             "code": err.code})
        return
    assert last is not None and last.finished
    reason = last.outputs[0].finish_reason
    for e in w.ensure_output():
        yield e
    for e in w.close("incomplete" if reason == "length" else "completed"):
        yield e
    resp = _finish(base, w.items, reason, _usage(state, prep, last))
    _save(store, req, conversation, resp)
    done = "response.incomplete" if resp.status == "incomplete" else "response.completed"
    yield w.event(done, response=resp.model_dump(mode="json"))

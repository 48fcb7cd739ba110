"""`formwork run-batch`: an OpenAI Batch API file through the server's own request
path, offline (vLLM's `python -m vllm.entrypoints.openai.run_batch`).

    formwork run-batch -i requests.jsonl -o results.jsonl [MODEL] [serve flags]

Each input line is one request in OpenAI's batch input format:
    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
`url` is /v1/chat/completions, /v1/completions or /v1/responses; `body` is that
endpoint's request, taken exactly as `formwork serve` takes it (structured
outputs, tools, vLLM's fields; errors named the same way): the app of `formwork
serve` runs in this process, its engine started once, and the lines go to it
concurrently (`--concurrency`, default twice --max-num-seqs), so continuous
batching does the rest. Nothing listens on a port.

Each output line, in input order, is OpenAI's batch output format:
    {"id": "batch_req_...", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}
A request the server refused keeps its HTTP status and error body in `response`
(400 with `error.param`, as the server answers); a line that is no request at
all (not JSON, no `custom_id`, a repeated `custom_id`, a method other than POST,
another url, `stream: true`) has `response: null` and `error: {"code",
"message"}`. No line is dropped. Lines are written as soon as every line before
them is done. Exit status 0 once the file is processed (failures are in it, as
in OpenAI's batches), 2 for usage errors before the model loads.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from typing import Any, TextIO

from formwork.gateway.json_lines import dumps_line

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """run-batch's own flags (gateway/cli.py adds serve's: the model, every engine and
    request option)."""
    p.add_argument("-i", "--input-file", required=True,
                   help="batch input JSONL (OpenAI's format), or - for stdin")
    p.add_argument("-o", "--output-file", required=True,
                   help="batch output JSONL, or - for stdout")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight (default: twice --max-num-seqs)")


def _error_line(custom_id: Any, code: str, message: str) -> dict:
    from formwork.schemas.openai_base import random_id
    return {"id": random_id("batch_req_"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def parse_line(text: str, number: int, seen: set[str]) -> tuple[str, str, dict] | dict:
    """(custom_id, url, body) of input line `number` (1-based), or its output line
    when it is no request this runner serves."""
    try:
        item = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        return _error_line(None, "invalid_json", f"line {number}: not valid JSON: {e}")
    if not isinstance(item, dict):
        return _error_line(None, "invalid_request", f"line {number}: a request is a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _error_line(custom_id, "invalid_request",
                           f"line {number}: custom_id: a non-empty string is required")
    if custom_id in seen:
        return _error_line(custom_id, "duplicate_custom_id",
                           f"line {number}: custom_id {custom_id!r} was used on an earlier line")
    seen.add(custom_id)
    method, url, body = item.get("method", "POST"), item.get("url"), item.get("body")
    if method != "POST":
        return _error_line(custom_id, "invalid_request",
                           f"line {number}: method: only POST is served, got {method!r}")
    if url not in URLS:
        return _error_line(custom_id, "invalid_url",
                           f"line {number}: url: one of {', '.join(URLS)}, got {url!r}")
    if not isinstance(body, dict):
        return _error_line(custom_id, "invalid_request", f"line {number}: body: a JSON object "
                                                         "is required")
    if body.get("stream"):
        return _error_line(custom_id, "invalid_request", f"line {number}: body.stream: "
                                                         "streaming is not served in a batch")
    return custom_id, url, body


def _output_line(custom_id: str, status: int, body: Any) -> dict:
    from formwork.schemas.openai_base import random_id
    request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) \
        else random_id("req_")
    return {"id": random_id("batch_req_"), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None}


class _OrderedWriter:
    """Writes result i once results 0..i-1 are written (input order, as they finish)."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.next = out, 0
        self.done: dict[int, dict] = {}

    def put(self, index: int, line: dict) -> None:
        self.done[index] = line
        while self.next in self.done:
            self.out.write(dumps_line(self.done.pop(self.next)) + "\n")
            self.next += 1
        self.out.flush()


async def run_lines(app, lines: list[str], out: TextIO, concurrency: int) -> dict[str, int]:
    """Every line through `app` (its lifespan started here), results to `out` in input
    order; counts of ok / refused (HTTP status >= 400) / invalid lines."""
    import httpx

    counts = {"ok": 0, "refused": 0, "invalid": 0}
    writer, seen = _OrderedWriter(out), set()
    parsed = [parse_line(text, i + 1, seen) for i, text in enumerate(lines)]
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://formwork.batch",
                                     timeout=None) as client:
            gate = asyncio.Semaphore(max(1, concurrency))

            async def one(index: int, request) -> None:
                if isinstance(request, dict):             # an output line already
                    counts["invalid"] += 1
                    writer.put(index, request)
                    return
                custom_id, url, body = request
                async with gate:
                    r = await client.post(url, json=body)
                try:
                    data = r.json()
                except ValueError:
                    data = {"error": {"message": r.text, "type": "server_error",
                                      "param": None, "code": None}}
                counts["ok" if r.status_code < 400 else "refused"] += 1
                writer.put(index, _output_line(custom_id, r.status_code, data))

            await asyncio.gather(*(one(i, req) for i, req in enumerate(parsed)))
    return counts


def _read_lines(path: str) -> list[str]:
    # Text mode has made every line end "\n"; str.splitlines() would also break a
    # line at U+2028 / U+0085 / U+2029, which JSON allows raw inside a string.
    text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    return [line for line in text.split("\n") if line.strip()]


def run(args: argparse.Namespace, config, requests) -> int:
    """`config` (EngineConfig) and `requests` (RequestOptions): serve's, from `args`."""
    import logging

    from formwork.gateway.api_server import build_app

    try:
        if args.concurrency is not None and args.concurrency < 1:
            raise ValueError("--concurrency: must be at least 1")
        lines = _read_lines(args.input_file)
    except (ValueError, OSError) as e:
        print(f"formwork run-batch: {e}", file=sys.stderr)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)     # a line per request otherwise
    app = build_app(config, served_model_names=args.served_model_name,
                    chat_template=args.chat_template, reasoning_parser=args.reasoning_parser,
                    requests=requests)
    concurrency = args.concurrency or 2 * config.max_num_seqs * config.data_parallel_size
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        out = sys.stdout if args.output_file == "-" else \
            stack.enter_context(open(args.output_file, "w", encoding="utf-8"))
        counts = asyncio.run(run_lines(app, lines, out, concurrency))
    print(f"formwork run-batch: {len(lines)} request{'' if len(lines) == 1 else 's'}: "
          f"{counts['ok']} answered, "
          f"{counts['refused']} refused by the server, {counts['invalid']} not requests, "
          f"in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return 0

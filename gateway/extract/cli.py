"""`formwork extract`: documents in, one schema-valid JSON record per document out.

    formwork extract --schema invoice.json docs/ -o out.jsonl
    formwork extract --schema models.py:Contact notes.jsonl --text-field body --id-field id
    formwork extract --schema contact.json - < letter.txt
    formwork extract --schema invoice.json --server http://127.0.0.1:8000 docs/

Each document becomes one chat request: a system message (the instructions and
the schema) and a user message (the document), decoded under the schema as a
structured-output constraint, greedy unless --temperature. Offline (the
default), every document goes to the in-process engine in one call and
continuous batching does the rest; with --server the requests go concurrently
(--concurrency) to a running `formwork serve` or any OpenAI-compatible endpoint.

Output (-o FILE or stdout): one JSON line per document as soon as it is known
(documents that were not sent first, then in completion order, so an interrupted
run keeps what finished for --resume); `id` and `source` name the document:
    {"id", "source", "data", "valid", "finish_reason", "error",
     "usage": {"prompt_tokens", "completion_tokens"}, "truncated"}
`data` is the parsed output (null when it does not parse); `valid` is true only
when the output finished normally, parses and validates against the schema
(jsonschema) and, for --schema file.py:Model, against the model itself
(`Model.model_validate`: an HttpUrl's scheme, field validators). Invalid JSON,
schema violations, outputs cut by --max-tokens, unreadable inputs and server
errors are recorded with valid=false and an `error`; no document is dropped.

Long documents: when the prompt plus --max-tokens exceeds the model's context,
the end of the document is cut so that it fits; a warning goes to stderr and
the record says "truncated": true. `--on-long skip` records such a document as
failed instead. Offline the engine's tokenizer measures the prompt; with
--server the server's POST /tokenize and /detokenize do (see
gateway/extract/server.py), and a server without them gets documents whole.

Text: a byte-order mark names the encoding (UTF-8/16/32), else UTF-8, else
Windows-1252 (most non-UTF-8 text files); a file with NUL bytes (PDF, image...)
and an empty or blank document are recorded as failed, never sent.

Ids: a file found in a folder -> its path relative to that folder; a file named
on the command line -> the path as given; `-` -> "stdin"; a JSONL line -> its
--id-field value, else "PATH:LINE". --resume appends to -o and skips ids it
already holds (valid or not).

Exit status: 0 when every document is valid (or --allow-failures), 1 when any
failed or was invalid, 2 for usage and schema errors, which are reported before
any model is loaded.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time

from formwork.gateway.engine_args import add_engine_arguments, engine_config
from formwork.gateway.extract.inputs import (DEFAULT_GLOBS, Document, UsageError, collect_documents,
                                             load_schema_and_model)
from formwork.gateway.extract.offline import extract_offline
from formwork.gateway.extract.prompt import DEFAULT_INSTRUCTIONS, ExtractOptions
from formwork.gateway.extract.records import RecordSink, Summary, done_ids
from formwork.gateway.extract.server import extract_server

# -- command line ---------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description, p.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text/markdown files, folders (searched recursively, see --glob), "
                        ".jsonl files (see --text-field), or - for stdin (one document)")
    p.add_argument("--schema", required=True, metavar="SCHEMA",
                   help="JSON Schema file, module:PydanticModel or path/to/file.py:Model")
    p.add_argument("--instructions", default=DEFAULT_INSTRUCTIONS,
                   help="system instructions, sent before the schema (default: %(default)r)")
    p.add_argument("-o", "--output", default=None, metavar="OUT.jsonl",
                   help="write records here (default: stdout)")
    p.add_argument("--resume", action="store_true",
                   help="append to -o, skipping documents whose id it already holds")
    p.add_argument("--glob", action="append", default=None, metavar="PATTERN",
                   help=f"file pattern inside folders, repeatable (default: {' '.join(DEFAULT_GLOBS)})")
    p.add_argument("--text-field", default="text", help="JSONL: field holding the text")
    p.add_argument("--id-field", default=None, help="JSONL: field holding the id (default: PATH:LINE)")
    p.add_argument("--max-tokens", type=int, default=512, help="per document (default: 512)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--on-long", choices=("truncate", "skip"), default="truncate",
                   help="a document whose prompt + --max-tokens exceeds the context: cut its end "
                        "to fit (warning on stderr, \"truncated\": true in its record) or record "
                        "it as failed (default: truncate; --server measures with the server's "
                        "/tokenize)")
    p.add_argument("--allow-failures", action="store_true",
                   help="exit 0 even when some documents failed or were invalid")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--model", default=None,
                       help="offline engine model: name, .gguf or HF folder (default: SmolLM2-135M-Instruct)")
    where.add_argument("--server", default=None, metavar="URL",
                       help="send to a running formwork serve / OpenAI-compatible server instead")
    s = p.add_argument_group("--server")
    s.add_argument("--api-key", default=os.environ.get("FORMWORK_API_KEY"),
                   help="bearer key for --server (env FORMWORK_API_KEY)")
    s.add_argument("--server-model", default=None, help="model name (default: the server's first)")
    s.add_argument("--concurrency", type=int, default=16, help="requests in flight (default: 16)")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    add_engine_arguments(p)


def _prepare(args: argparse.Namespace) -> tuple[ExtractOptions, list[Document]]:
    """Options and the documents still to do; every usage error surfaces here."""
    for name in ("max_tokens", "concurrency"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}: must be >= 1")
    if args.resume and not args.output:
        raise UsageError("--resume needs -o OUT.jsonl")
    schema, model = load_schema_and_model(args.schema)
    opts = ExtractOptions(schema=schema, model=model, instructions=args.instructions,
                          max_tokens=args.max_tokens, temperature=args.temperature,
                          on_long=args.on_long)
    try:
        opts.sampling_params()
        limit = None if args.server else engine_config(args).max_model_len
    except ValueError as e:
        raise UsageError(str(e)) from None
    if limit is not None:       # a context given on the command line: checked before loading
        _check_room(opts.max_tokens, limit)
    docs = collect_documents(args.inputs, globs=tuple(args.glob or DEFAULT_GLOBS),
                             text_field=args.text_field, id_field=args.id_field)
    if args.resume:
        done = done_ids(args.output)
        docs = [d for d in docs if d.id not in done]
    return opts, docs


def _check_room(max_tokens: int, max_model_len: int) -> None:
    if max_tokens >= max_model_len:
        raise UsageError(f"--max-tokens {max_tokens} leaves no room for a prompt: "
                         f"max_model_len is {max_model_len}")


def _load_llm(args: argparse.Namespace, quiet: bool):
    from formwork.gateway.llm import LLM  # torch and the engine: only when a model is loaded here

    try:
        config = engine_config(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not quiet:
        print(f"formwork extract: loading {args.model or 'the default model'} ...",
              file=sys.stderr, flush=True)
    return LLM(**dataclasses.asdict(config))


def run(args: argparse.Namespace, *, llm=None) -> int:
    """The `extract` subcommand; `llm` (an offline gateway.LLM) replaces --model."""
    sink, summary = RecordSink(args.output, append=args.resume), Summary()

    def emit(rec: dict) -> None:
        sink.write(rec)
        summary.add(rec)

    try:
        opts, docs = _prepare(args)
        if not docs:
            print("formwork extract: nothing to do (every document is already in the output)",
                  file=sys.stderr)
            return 0
        if args.server:
            t0 = time.perf_counter()
            asyncio.run(extract_server(
                docs, opts, emit, base_url=args.server, api_key=args.api_key,
                model=args.server_model, concurrency=args.concurrency, timeout_s=args.timeout,
                progress=not args.quiet))
        else:
            llm = llm if llm is not None else _load_llm(args, args.quiet)
            _check_room(opts.max_tokens, llm.engine.max_model_len)
            t0 = time.perf_counter()
            extract_offline(llm, docs, opts, emit, progress=not args.quiet)
    except UsageError as e:
        print(f"formwork extract: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("formwork extract: interrupted; rerun with --resume to continue", file=sys.stderr)
        return 130
    finally:
        sink.close()
    print(f"formwork extract: {summary.line(time.perf_counter() - t0)}", file=sys.stderr)
    return 0 if summary.ok == len(docs) or args.allow_failures else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="formwork extract")
    add_arguments(parser)
    return run(parser.parse_args(argv))


"""The `formwork` command: `formwork serve [MODEL] ...` and `formwork extract ...`.

`extract` lives in gateway/extract/cli.py (add_arguments(parser), run(args) -> int)
and is imported only when that subcommand runs; it imports nothing from here.
"""
from __future__ import annotations

import argparse
import logging
import os
import pathlib
import sys

from formwork.gateway.engine_args import FLAGS, add_engine_arguments, engine_config
from formwork.gateway.reasoning import PARSERS
from formwork.gateway.serve_options import (add_http_arguments, jinja_syntax_error,
                                           options_from_args)
from formwork.gateway.tools import TOOL_FORMATS
from formwork.gateway.version import version


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="model name, .gguf file or HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("FORMWORK_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
                        "(env FORMWORK_API_KEY)")
    p.add_argument("--max-request-body-mb", type=float, default=8.0,
                   help="larger request bodies get 413 before they are read")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="generation requests that may wait beyond the --max-num-seqs running "
                        "ones; more get 429 with Retry-After at once (0: no limit)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds that requests in flight get to finish after SIGTERM (new ones "
                        "get 503 meanwhile); the rest then end with an error")
    p.add_argument("--max-engine-restarts", type=int, default=5,
                   help="consecutive failed restarts of a dead engine after which the server "
                        "exits non-zero (for an outside supervisor)")
    p.add_argument("--engine-restart-backoff", type=float, default=1.0,
                   help="seconds before the first restart of a dead engine; doubled after each "
                        "failed one, at most 30")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names the API answers to (default: the model name)")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) in place of "
                        "the model's (as vLLM's --chat-template)")
    add_engine_arguments(p)
    add_http_arguments(p)
    _add_vllm_arguments(p)


# `vllm serve` flags, so that a vLLM command line runs with `vllm` swapped for
# `formwork`: the ones with a meaning here are mapped onto formwork's flags
# (`apply_vllm_arguments`), the ones with nothing to do are accepted and ignored.
_VLLM_NO_OPS = {
    "--trust-remote-code": "the loader runs no model code",
    "--enable-auto-tool-choice": "tool_choice auto is always served",
    "--disable-log-requests": "requests are not logged one by one",
    "--disable-log-stats": "no periodic stats log (GET /metrics has them)",
    "--enable-prefix-caching": "prefix caching is on by default (--no-prefix-caching turns it off)",
    "--enable-chunked-prefill": "chunked prefill is on by default",
}


def _add_vllm_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM command lines", "`vllm serve` flags, taken as they mean here")
    g.add_argument("--model", dest="model_flag", default=None, help="the model (as MODEL)")
    for flag, why in _VLLM_NO_OPS.items():
        g.add_argument(flag, action="store_true", dest="vllm_" + flag[2:].replace("-", "_"),
                       help=f"accepted: {why}")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", help="= --no-prefix-caching")
    g.add_argument("--tool-call-parser", choices=tuple(TOOL_FORMATS), default=None,
                   help="how the model writes tool calls in free text (tool_choice auto): "
                        "hermes (<tool_call>{...}</tool_call>, the default: Qwen, Hermes, "
                        "formwork's own tools prompt) or llama3_json ({\"name\": ..., "
                        "\"parameters\": ...}: Llama 3.1-3.3's templates)")
    g.add_argument("--reasoning-parser", choices=PARSERS, default=None,
                   help="a thinking model's <think>...</think> text goes to the chat "
                        "message's `reasoning` (and `reasoning_content`), the rest to "
                        "`content` (unconstrained requests and tool_choice auto)")
    g.add_argument("--guided-decoding-backend", default=None,
                   choices=FLAGS["structured_backend"].choices,
                   help="= --structured-outputs-backend")
    g.add_argument("--kv-cache-dtype", choices=("auto",), default=None,
                   help="the KV cache is kept in the model's dtype")
    g.add_argument("--swap-space", type=float, default=None,
                   help="accepted: preempted requests are recomputed, not swapped")
    g.add_argument("--uvicorn-log-level", default=None,
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="= --log-level (trace: debug)")


def apply_vllm_arguments(args: argparse.Namespace) -> None:
    """Fold the vLLM spellings into formwork's arguments; ValueError on a conflict."""
    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            raise ValueError(f"two models given: {args.model!r} and --model {args.model_flag!r}")
        args.model = args.model_flag
    if args.guided_decoding_backend is not None:
        args.structured_backend = args.guided_decoding_backend
    if args.uvicorn_log_level is not None:
        args.log_level = "debug" if args.uvicorn_log_level == "trace" else args.uvicorn_log_level


def serve(args: argparse.Namespace) -> int:
    from formwork.gateway.api_server import run_server   # the server: only when it runs

    try:
        apply_vllm_arguments(args)
    except ValueError as e:
        print(f"formwork serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config(args)
        check_serve_arguments(args)
        http, requests = options_from_args(args)
    except ValueError as e:
        print(f"formwork serve: {e}", file=sys.stderr)
        return 2
    return run_server(config, host=args.host, port=args.port,
                      served_model_names=args.served_model_name, api_key=args.api_key,
                      log_level=args.log_level, max_request_body_mb=args.max_request_body_mb,
                      max_waiting_requests=args.max_waiting_requests,
                      drain_timeout_s=args.drain_timeout,
                      engine_restarts=dict(max_restarts=args.max_engine_restarts,
                                           restart_backoff_s=args.engine_restart_backoff),
                      chat_template=args.chat_template, reasoning_parser=args.reasoning_parser,
                      http=http, requests=requests)


def load_chat_template(spec: str) -> str:
    """--chat-template's text: a file's contents, else the argument itself (vLLM's
    rule); ValueError for a template Jinja cannot parse."""
    text = pathlib.Path(spec).read_text(encoding="utf-8") if os.path.isfile(spec) else spec
    if "{" not in text:
        raise ValueError(f"--chat-template: {spec!r} is neither a file nor a Jinja template")
    if (error := jinja_syntax_error(text)) is not None:
        raise ValueError(f"--chat-template: not a valid Jinja template: {error}")
    return text


def check_serve_arguments(args: argparse.Namespace) -> None:
    """ValueError naming the flag of a serve-only value out of range (and reads
    --chat-template's file)."""
    if args.chat_template is not None:
        args.chat_template = load_chat_template(args.chat_template)
    if args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests: must be >= 0 (0: no limit), "
                         f"got {args.max_waiting_requests}")
    if args.max_engine_restarts < 0:
        raise ValueError(f"--max-engine-restarts: must be >= 0, got {args.max_engine_restarts}")
    if not 0 < args.engine_restart_backoff <= 30:
        raise ValueError(f"--engine-restart-backoff: must be a number of seconds in (0, 30], "
                         f"got {args.engine_restart_backoff}")
    if not 0 <= args.drain_timeout < float("inf"):
        raise ValueError(f"--drain-timeout: must be a number of seconds >= 0, "
                         f"got {args.drain_timeout}")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="formwork", description="Structured-output-first LLM serving")
    parser.add_argument("--version", action="version", version=f"formwork {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser("serve", help="run the OpenAI-compatible server"))
    extract = sub.add_parser("extract", help="extract structured data from text with a schema")
    if argv[:1] == ["extract"]:
        from formwork.gateway.extract import cli as extract_cli  # the app: only when it runs
        extract_cli.add_arguments(extract)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    if args.command == "serve":
        return serve(args)
    from formwork.gateway.extract import cli as extract_cli
    return extract_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())

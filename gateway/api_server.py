"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

`build_app(config, ...)` returns an app whose lifespan loads the tokenizer,
spawns the EngineCore process and shuts it down again; `run_server` serves it.
Routes (gateway/routes.py): POST /v1/chat/completions, POST /v1/completions, POST /v1/responses
(GET / DELETE /v1/responses/{id} for stored ones), GET /v1/models,
POST /tokenize, POST /detokenize (vLLM's), GET /health (and vLLM's /ping), GET /metrics,
GET /version. With an API key set, /v1/*, /tokenize and /detokenize need
`Authorization: Bearer <key>`.

SIGTERM drains, then the server exits 0 (gateway/shutdown.py); an engine
that cannot be restarted ends it with FATAL_EXIT_CODE.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from uvicorn.config import STARTUP_FAILURE

from formwork.core.engine_proc import cuda_graphs_text
from formwork.gateway.admission import (DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_MAX_WAITING, Admission,
                                        AdmissionMiddleware, max_generating)
from formwork.gateway.constraint_check import ConstraintChecker
from formwork.gateway.dp_client import DPEngineClient
from formwork.gateway.engine_factory import make_engine_client
from formwork.gateway.errors import APIError, install_error_handlers
from formwork.gateway.limits import DEFAULT_MAX_BODY_MB, BodyLimitMiddleware, longest_token_chars
from formwork.gateway import output_check
from formwork.gateway.metrics import Metrics
from formwork.gateway.responses_store import ResponseStore
from formwork.gateway.routes import dev_mode, dev_router, router
from formwork.gateway.serve_options import (HTTPOptions, RequestOptions, generation_defaults,
                                           generation_eos_ids)
from formwork.gateway.version import version
from formwork.gateway.serving import ServerState
from formwork.gateway.shutdown import DrainingServer, drain, exit_for_supervisor
from formwork.gateway.tokenizer_pool import TokenizerPool
from formwork.gpu.model_files import DEFAULT_MODEL, load_model_tokenizer, resolve_model
from formwork.schemas.config import EngineConfig

log = logging.getLogger("formwork.gateway")
# Idle keep-alive connections are kept longer than HTTP clients keep them in their
# pools (httpx, under the openai SDK: 5 s): at uvicorn's default, also 5 s, a
# client reusing a connection just as the server closes it loses its POST with a
# ReadError (seen in bench/soak.py). nginx's default is 75 s.
KEEP_ALIVE_S = 75
# outside /v1, still behind the API key
KEYED_PATHS = ("/tokenize", "/detokenize", "/invocations", "/reset_prefix_cache")


class AuthMiddleware:
    """Pure ASGI (keeps streaming cancellation intact): checks the bearer key on /v1/*
    and KEYED_PATHS."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1") or path in KEYED_PATHS) \
                and scope.get("method") != "OPTIONS":
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"")
            if not auth:
                err = APIError(401, "You didn't provide an API key. Send it in the Authorization "
                               "header: 'Authorization: Bearer YOUR_KEY'.", code="invalid_api_key")
                return await err.to_response()(scope, receive, send)
            scheme, _, token = auth.partition(b" ")
            # RFC 7235: the auth scheme is case-insensitive ("bearer" too)
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                err = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
                return await err.to_response()(scope, receive, send)
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """--enable-request-id-headers (vLLM's): every HTTP response carries X-Request-Id,
    the request's own header (so a client's id follows it through a proxy) or a new id."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").strip()
        request_id = given[:256] if given else uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


async def _start(config: EngineConfig, engine_restarts: dict | None = None,
                 chat_template: str | None = None):
    """(engine, release_engines, tokenizer, tokenizer pool, longest token, info): the
    engine process loads the model while this one loads the tokenizer.
    `engine_restarts`: EngineClient's max_restarts / restart_backoff_s;
    `chat_template`: replaces the tokenizer's (its copies included)."""
    engine, release_engines = make_engine_client(config, on_fatal=exit_for_supervisor,
                                                 **(engine_restarts or {}))
    starting = asyncio.create_task(engine.start())
    try:
        tokenizer = await asyncio.to_thread(load_model_tokenizer, config.model,
                                             weights=config.reads_weights)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        max_token_chars = await asyncio.to_thread(longest_token_chars, tokenizer)
        tokenizers = await asyncio.to_thread(TokenizerPool, tokenizer)
        engine.set_tokenizer(tokenizer)
        info = await starting
    except BaseException:
        starting.cancel()
        await engine.shutdown()
        release_engines()
        raise
    return engine, release_engines, tokenizer, tokenizers, max_token_chars, info


def _log_ready(config: EngineConfig, names: tuple[str, ...], engine, info, t0: float) -> None:
    log.info("engine ready in %.1f s", time.monotonic() - t0)
    log.info("formwork %s serving %s as %s | %s on %s | KV cache %d blocks x %d tokens | "
             "max_model_len %d | attention %s | CUDA graphs %s | structured outputs %s | "
             "engine pid %d", version(), config.model or DEFAULT_MODEL, ", ".join(names),
             info.dtype, info.device, info.num_kv_blocks, info.block_size,
             info.max_model_len, info.attention_backend,
             cuda_graphs_text(info.cuda_graph_sizes), info.structured_backend, info.pid)
    if isinstance(engine, DPEngineClient):
        log.info("data parallel: %d engines (pids %s), each with its own KV cache of %d "
                 "blocks", config.data_parallel_size, engine.pids, info.num_kv_blocks)


def _lifespan(config: EngineConfig, names: tuple[str, ...], api_key: str | None,
              engine_restarts: dict | None = None, chat_template: str | None = None,
              reasoning_parser: str | None = None, requests: RequestOptions | None = None):
    """The app's lifespan: start the engine and the tokenizer, serve, shut down."""
    requests = requests or RequestOptions()
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        t0 = time.monotonic()
        engine, release_engines, tokenizer, tokenizers, max_token_chars, info = \
            await _start(config, engine_restarts, chat_template)
        _log_ready(config, names, engine, info, t0)
        folder = str(resolve_model(config.model, weights=False))
        defaults = generation_defaults(requests.generation_config, folder,
                                       requests.override_generation_config)
        extra_stop = generation_eos_ids(folder, tokenizer.eos_token_id)
        if defaults:
            log.info("sampling defaults for fields a request leaves out (--generation-config "
                     "%s): %s", requests.generation_config, defaults)
        constraints = ConstraintChecker()
        app.state.server = ServerState(engine=engine, tokenizer=tokenizer,
                                       served_model_names=names,
                                       max_model_len=info.max_model_len,
                                       metrics=Metrics(names[0]), api_key=api_key,
                                       max_token_chars=max_token_chars, tokenizers=tokenizers,
                                       scheduling_policy=config.scheduling_policy,
                                       reasoning_parser=reasoning_parser,
                                       options=requests, default_sampling=defaults,
                                       extra_stop_ids=extra_stop, constraints=constraints)
        warm = asyncio.create_task(asyncio.to_thread(constraints.start))
        warm_classes = asyncio.create_task(asyncio.to_thread(output_check.warm))
        try:
            yield
        finally:
            log.info("shutting down the engine")
            warm.cancel()
            warm_classes.cancel()
            constraints.shutdown()
            tokenizers.shutdown()
            await engine.shutdown()
            release_engines()
    return lifespan


def build_app(config: EngineConfig, *, served_model_names: list[str] | None = None,
              api_key: str | None = None,
              max_request_body_mb: float = DEFAULT_MAX_BODY_MB,
              admission: Admission | None = None,
              engine_restarts: dict | None = None,
              chat_template: str | None = None,
              reasoning_parser: str | None = None,
              http: HTTPOptions | None = None,
              requests: RequestOptions | None = None) -> FastAPI:
    """`admission`: the bound on generation requests in flight (default: none);
    `engine_restarts`: max_restarts / restart_backoff_s of the engine client;
    `chat_template`: a Jinja chat template in place of the tokenizer's;
    `reasoning_parser`: vLLM's --reasoning-parser (gateway/reasoning.py); `http` (CORS)
    and `requests`: the serve options of gateway/serve_options.py."""
    http = http or HTTPOptions()
    names = tuple(served_model_names or [config.model or DEFAULT_MODEL])
    docs = {} if http.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="formwork", version=version(), **docs,
                  lifespan=_lifespan(config, names, api_key, engine_restarts, chat_template,
                                     reasoning_parser, requests))
    app.state.admission = admission or Admission(None)
    app.state.responses = ResponseStore()      # store/previous_response_id (last 1000)
    install_error_handlers(app)
    app.include_router(router)
    if dev_mode():
        app.include_router(dev_router)
    app.add_middleware(AdmissionMiddleware, admission=app.state.admission)
    if api_key:
        app.add_middleware(AuthMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=int(max_request_body_mb * 2**20))
    if http.request_id_headers:    # outside the key check: refusals carry the id too
        app.add_middleware(RequestIdMiddleware)
    if http.allowed_origins:       # outermost: preflights are answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(http.allowed_origins),
                           allow_credentials=http.allow_credentials,
                           allow_methods=list(http.allowed_methods),
                           allow_headers=list(http.allowed_headers))
    return app


def run_server(config: EngineConfig, *, host: str, port: int,
               served_model_names: list[str] | None = None, api_key: str | None = None,
               log_level: str = "info", max_request_body_mb: float = DEFAULT_MAX_BODY_MB,
               max_waiting_requests: int = DEFAULT_MAX_WAITING,
               drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
               engine_restarts: dict | None = None, chat_template: str | None = None,
               reasoning_parser: str | None = None, http: HTTPOptions | None = None,
               requests: RequestOptions | None = None) -> int:
    """Serve until SIGTERM (drained) or SIGINT; the exit status."""
    admission = Admission(max_generating(config.max_num_seqs * config.data_parallel_size,
                                         max_waiting_requests))
    app = build_app(config, served_model_names=served_model_names, api_key=api_key,
                    max_request_body_mb=max_request_body_mb, admission=admission,
                    engine_restarts=engine_restarts, chat_template=chat_template,
                    reasoning_parser=reasoning_parser, http=http, requests=requests)
    http = http or HTTPOptions()
    server = DrainingServer(
        uvicorn.Config(app, host=host, port=port, log_level=log_level,
                       timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S,
                       root_path=http.root_path, access_log=http.access_log,
                       ssl_keyfile=http.ssl_keyfile, ssl_certfile=http.ssl_certfile,
                       ssl_ca_certs=http.ssl_ca_certs, ssl_cert_reqs=http.ssl_cert_reqs),
        on_sigterm=lambda: drain(app, drain_timeout_s))
    with contextlib.suppress(KeyboardInterrupt):     # uvicorn re-raises a SIGINT it handled
        server.run()
    return 0 if server.started else STARTUP_FAILURE

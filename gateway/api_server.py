"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

`build_app(config, ...)` returns an app whose lifespan loads the tokenizer,
spawns the EngineCore process and shuts it down again; `run_server` serves it.
Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses
(GET / DELETE /v1/responses/{id} for stored ones), GET /v1/models,
POST /tokenize, POST /detokenize (vLLM's), GET /health, GET /metrics,
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
from importlib import metadata
from typing import Any

import uvicorn
from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from uvicorn.config import STARTUP_FAILURE

from formwork.core.engine_proc import cuda_graphs_text
from formwork.gateway.admission import (DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_MAX_WAITING, Admission,
                                        AdmissionMiddleware, max_generating)
from formwork.gateway.dp_client import DPEngineClient
from formwork.gateway.dp_router import sum_stats
from formwork.gateway.engine_factory import make_engine_client
from formwork.gateway.errors import APIError, EngineDeadError, install_error_handlers
from formwork.gateway.limits import DEFAULT_MAX_BODY_MB, BodyLimitMiddleware, longest_token_chars
from formwork.gateway.metrics import CONTENT_TYPE, Metrics
from formwork.gateway.responses_store import ResponseStore
from formwork.gateway.serving import ServerState
from formwork.gateway.serving_chat import create_chat_completion
from formwork.gateway.serving_completion import create_completion
from formwork.gateway.serving_responses import create_response
from formwork.gateway.serving_tokenize import detokenize, tokenize
from formwork.gateway.shutdown import DrainingServer, drain, exit_for_supervisor
from formwork.gateway.tokenizer_pool import TokenizerPool
from formwork.gpu.model_files import DEFAULT_MODEL, load_model_tokenizer
from formwork.schemas.config import EngineConfig
from formwork.schemas.openai import ChatCompletionRequest, CompletionRequest
from formwork.schemas.openai_base import ModelCard, ModelList
from formwork.schemas.openai_tokenize import DetokenizeRequest
from formwork.schemas.responses import ResponsesRequest

log = logging.getLogger("formwork.gateway")
KEYED_PATHS = ("/tokenize", "/detokenize")      # outside /v1, still behind the API key


def version() -> str:
    try:
        return metadata.version("formwork")
    except metadata.PackageNotFoundError:
        return "0.1.0"


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


def _state(request: Request) -> ServerState:
    state = getattr(request.app.state, "server", None)
    if state is None:
        raise EngineDeadError("The server is still starting.")
    return state


def _add_routes(app: FastAPI) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(_state(request), body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(_state(request), body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await create_response(_state(request), request.app.state.responses, body, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        _state(request)
        return JSONResponse(request.app.state.responses.get(response_id, "response_id").response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        request.app.state.responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/models")
    async def models(request: Request):
        state = _state(request)
        cards = [ModelCard(id=name, root=state.engine.config.model or DEFAULT_MODEL,
                           max_model_len=state.max_model_len)
                 for name in state.served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump(mode="json"))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        """One model object (OpenAI's retrieve); 404 model_not_found for others."""
        state = _state(request)
        state.check_model(model_id)
        card = ModelCard(id=model_id, root=state.engine.config.model or DEFAULT_MODEL,
                         max_model_len=state.max_model_len)
        return JSONResponse(card.model_dump(mode="json"))

    @app.post("/tokenize")
    async def tokenize_route(request: Request, body: dict[str, Any] = Body()):
        resp = await tokenize(_state(request), body)
        return JSONResponse(resp.model_dump(mode="json"))

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest, request: Request):
        return JSONResponse(detokenize(_state(request), body).model_dump(mode="json"))

    @app.get("/health")
    async def health(request: Request):
        """200 {"status": "ready"} while the engine answers (data parallel: while
        any engine answers; "engines" lists each one's state, pid and restarts);
        503 with the state ("draining", "restarting", "failed", or "unresponsive")
        and Retry-After otherwise."""
        engine = _state(request).engine
        extra = ({"engines": engine.engine_states()} if isinstance(engine, DPEngineClient)
                 else {})
        if request.app.state.admission.draining:
            return JSONResponse({"status": "draining", "engine_restarts": engine.restarts,
                                 **extra}, status_code=503, headers={"Retry-After": "5"})
        if engine.state == "ready" and await engine.is_healthy():
            return JSONResponse({"status": "ready", "engine_restarts": engine.restarts, **extra})
        status = engine.state if engine.state != "ready" else "unresponsive"
        return JSONResponse({"status": status, "engine_restarts": engine.restarts, **extra},
                            status_code=503, headers={"Retry-After": "5"})

    @app.get("/metrics")
    async def metrics(request: Request):
        state = _state(request)
        if isinstance(state.engine, DPEngineClient):
            per_engine = await state.engine.get_engine_stats()
            body = state.metrics.render(sum_stats(per_engine),
                                        state.engine.engine_samples(per_engine))
            return Response(body, media_type=CONTENT_TYPE)
        stats = None
        with contextlib.suppress(Exception):
            stats = await state.engine.get_stats()
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def get_version():
        return {"version": version()}


def build_app(config: EngineConfig, *, served_model_names: list[str] | None = None,
              api_key: str | None = None,
              max_request_body_mb: float = DEFAULT_MAX_BODY_MB,
              admission: Admission | None = None) -> FastAPI:
    """`admission`: the bound on generation requests in flight (default: none)."""
    names = tuple(served_model_names or [config.model or DEFAULT_MODEL])

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        t0 = time.monotonic()
        engine, release_engines = make_engine_client(config, on_fatal=exit_for_supervisor)
        # the engine process loads the model while this one loads the tokenizer
        starting = asyncio.create_task(engine.start())
        try:
            tokenizer = await asyncio.to_thread(load_model_tokenizer, config.model)
            max_token_chars = await asyncio.to_thread(longest_token_chars, tokenizer)
            tokenizers = await asyncio.to_thread(TokenizerPool, tokenizer)
            engine.set_tokenizer(tokenizer)
            info = await starting
        except BaseException:
            starting.cancel()
            await engine.shutdown()
            release_engines()
            raise
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
        app.state.server = ServerState(engine=engine, tokenizer=tokenizer,
                                       served_model_names=names,
                                       max_model_len=info.max_model_len,
                                       metrics=Metrics(names[0]), api_key=api_key,
                                       max_token_chars=max_token_chars, tokenizers=tokenizers)
        try:
            yield
        finally:
            log.info("shutting down the engine")
            tokenizers.shutdown()
            await engine.shutdown()
            release_engines()

    app = FastAPI(title="formwork", version=version(), lifespan=lifespan)
    app.state.admission = admission or Admission(None)
    app.state.responses = ResponseStore()      # store/previous_response_id (last 1000)
    install_error_handlers(app)
    _add_routes(app)
    app.add_middleware(AdmissionMiddleware, admission=app.state.admission)
    if api_key:
        app.add_middleware(AuthMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=int(max_request_body_mb * 2**20))
    return app


def run_server(config: EngineConfig, *, host: str, port: int,
               served_model_names: list[str] | None = None, api_key: str | None = None,
               log_level: str = "info", max_request_body_mb: float = DEFAULT_MAX_BODY_MB,
               max_waiting_requests: int = DEFAULT_MAX_WAITING,
               drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> int:
    """Serve until SIGTERM (drained) or SIGINT; the exit status."""
    admission = Admission(max_generating(config.max_num_seqs * config.data_parallel_size,
                                         max_waiting_requests))
    app = build_app(config, served_model_names=served_model_names, api_key=api_key,
                    max_request_body_mb=max_request_body_mb, admission=admission)
    server = DrainingServer(
        uvicorn.Config(app, host=host, port=port, log_level=log_level,
                       timeout_graceful_shutdown=5),
        on_sigterm=lambda: drain(app, drain_timeout_s))
    with contextlib.suppress(KeyboardInterrupt):     # uvicorn re-raises a SIGINT it handled
        server.run()
    return 0 if server.started else STARTUP_FAILURE

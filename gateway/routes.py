"""The HTTP routes of the OpenAI-compatible server (an APIRouter that
gateway/api_server.py's `build_app` includes): each hands its body to the
serving module that answers it, or reads the server's state (/health, /metrics,
/v1/models)."""
from __future__ import annotations

import contextlib
import os
from typing import Any

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse, Response

from formwork.gateway.dp_client import DPEngineClient
from formwork.gateway.dp_router import sum_stats
from formwork.gateway.errors import APIError, EngineDeadError, bad_request, parse_body
from formwork.gateway.metrics import CONTENT_TYPE
from formwork.gateway.serving import ServerState
from formwork.gateway.serving_chat import create_chat_completion
from formwork.gateway.serving_completion import create_completion
from formwork.gateway.serving_responses import create_response
from formwork.gateway.serving_tokenize import detokenize, tokenize
from formwork.gateway.version import version
from formwork.gpu.model_files import DEFAULT_MODEL
from formwork.schemas.openai import ChatCompletionRequest, CompletionRequest
from formwork.schemas.openai_base import ModelCard, ModelList
from formwork.schemas.openai_tokenize import DetokenizeRequest
from formwork.schemas.responses import ResponsesRequest

router = APIRouter()


def _state(request: Request) -> ServerState:
    state = getattr(request.app.state, "server", None)
    if state is None:
        raise EngineDeadError("The server is still starting.")
    return state


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await create_chat_completion(_state(request), body, request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await create_completion(_state(request), body, request)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    return await create_response(_state(request), request.app.state.responses, body, request)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    _state(request)
    return JSONResponse(request.app.state.responses.get(response_id, "response_id").response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    request.app.state.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/invocations")
async def invocations(request: Request, body: dict[str, Any] = Body()):
    """SageMaker's inference route, read as vLLM reads it: a body with `messages` is
    a chat completion, one with `prompt` a completion (streamed or not, the same
    answers as /v1/chat/completions and /v1/completions)."""
    state = _state(request)
    if "messages" in body:
        return await create_chat_completion(state, parse_body(ChatCompletionRequest, body), request)
    if "prompt" in body:
        return await create_completion(state, parse_body(CompletionRequest, body), request)
    raise bad_request("invocations: the body is neither a chat completion request "
                      "('messages') nor a completion request ('prompt')", param="messages")


# Routes served only in development mode (VLLM_SERVER_DEV_MODE=1 or
# FORMWORK_SERVER_DEV_MODE=1, as vLLM gates its own): emptying the prefix cache takes
# every tenant's prefix hits away.
dev_router = APIRouter()
DEV_MODE_VARS = ("FORMWORK_SERVER_DEV_MODE", "VLLM_SERVER_DEV_MODE")


def dev_mode() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in DEV_MODE_VARS)


@dev_router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request):
    """Empty the engines' prefix caches (vLLM's dev-mode route, e.g. between benchmark
    runs): 200 {"reset": true}; 409 while requests are running (nothing changed)."""
    engine = _state(request).engine
    engines = engine.engines if isinstance(engine, DPEngineClient) else [engine]
    done = [(await e.call_utility("reset_prefix_cache")).done for e in engines]
    if not all(done):
        raise APIError(409, "The prefix cache was not reset: requests are running; retry "
                            "when the server is idle.", code="engine_busy")
    return {"reset": True}


@router.get("/load")
async def load(request: Request):
    """vLLM's server load: the generation requests in flight (what a load balancer
    reads to pick the least busy replica)."""
    return {"server_load": request.app.state.admission.generating}


@router.get("/v1/models")
async def models(request: Request):
    state = _state(request)
    cards = [ModelCard(id=name, root=state.engine.config.model or DEFAULT_MODEL,
                       max_model_len=state.max_model_len)
             for name in state.served_model_names]
    return JSONResponse(ModelList(data=cards).model_dump(mode="json"))


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    """One model object (OpenAI's retrieve); 404 model_not_found for others."""
    state = _state(request)
    state.check_model(model_id)
    card = ModelCard(id=model_id, root=state.engine.config.model or DEFAULT_MODEL,
                     max_model_len=state.max_model_len)
    return JSONResponse(card.model_dump(mode="json"))


@router.post("/tokenize")
async def tokenize_route(request: Request, body: dict[str, Any] = Body()):
    resp = await tokenize(_state(request), body)
    return JSONResponse(resp.model_dump(mode="json"))


@router.post("/detokenize")
async def detokenize_route(body: DetokenizeRequest, request: Request):
    return JSONResponse(detokenize(_state(request), body).model_dump(mode="json"))


# /ping: vLLM's (SageMaker's health check); one operation id per method (a shared
# one made the published OpenAPI document invalid: operation ids are unique)
@router.get("/health")
@router.get("/ping", operation_id="ping_get")
@router.post("/ping", operation_id="ping_post")
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


@router.get("/metrics")
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


@router.get("/version")
async def get_version():
    return {"version": version()}

"""The server's routes, in three routers: generation (OpenAI's ``/v1``), the tokenizer's, and
operations (health, version, metrics). Every status a route can answer is declared on it, with
OpenAI's error body, so ``/openapi.json`` describes what the server does."""

from __future__ import annotations

import asyncio
import importlib.metadata
import time
from collections.abc import Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from engine.entrypoints.metrics import Metrics
from engine.entrypoints.openai_serving import OpenAIServing
from engine.entrypoints.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    RequestError,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)

_WHY = {400: "invalid request: a bad field, malformed JSON, a prompt over the context",
        401: "missing or wrong API key (with --api-key)", 404: "the model named is not served",
        413: "the body is larger than --max-request-bytes", 500: "an internal error (a bug)",
        503: "the engine has stopped after an error"}
_POST_ERRORS = (400, 401, 404, 413, 500, 503)
# Completions and chat stream as server-sent events with ``stream``: the 200's second media type.
_STREAMS = {200: {"description": "the completion; with `stream`, server-sent events ending with `data: [DONE]`",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def errors(*statuses: int) -> dict:
    """FastAPI's ``responses`` for these error statuses, each with OpenAI's error body."""
    return {status: {"model": ErrorResponse, "description": _WHY[status]} for status in statuses}


class PrometheusResponse(Response):
    media_type = "text/plain; version=0.0.4; charset=utf-8"


def generation(serving: OpenAIServing, authorized: Callable) -> APIRouter:
    """``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions``."""
    router = APIRouter(dependencies=[Depends(authorized)])

    @router.get("/v1/models", response_model=ModelList, responses=errors(401, 500))
    async def list_models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": int(time.time()), "owned_by": "pallas-paged",
             "max_model_len": serving.max_model_len} for name in serving.model_names]}

    @router.post("/v1/completions", responses={**_STREAMS, **errors(*_POST_ERRORS)})
    async def completions(body: CompletionRequest, request: Request):
        if body.stream:
            return _stream(serving.completion_stream(body))
        return await _unless_disconnected(serving.completion(body), request)

    @router.post("/v1/chat/completions", responses={**_STREAMS, **errors(*_POST_ERRORS)})
    async def chat_completions(body: ChatRequest, request: Request):
        if body.stream:
            return _stream(serving.chat_stream(body))
        return await _unless_disconnected(serving.chat(body), request)

    return router


def tokenizer(serving: OpenAIServing, authorized: Callable) -> APIRouter:
    """vLLM's ``POST /tokenize`` and ``POST /detokenize``."""
    router = APIRouter(dependencies=[Depends(authorized)])

    @router.post("/tokenize", response_model=TokenizeResponse, responses=errors(*_POST_ERRORS))
    async def tokenize(body: TokenizeRequest):
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("send exactly one of prompt or messages")
        if body.prompt is not None:
            tokens = serving.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            tokens = serving.chat_ids(body)
        strings = serving.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {"tokens": tokens, "count": len(tokens), "max_model_len": serving.max_model_len, "token_strs": strings}

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=errors(*_POST_ERRORS))
    async def detokenize(body: DetokenizeRequest):
        serving.check_model(body.model)
        vocab = serving.engine.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise RequestError(f"tokens must be in [0, {vocab})")
        return {"prompt": serving.tokenizer.decode(body.tokens)}

    return router


def operations(serving: OpenAIServing, metrics: Metrics) -> APIRouter:
    """``GET /health`` (an empty 200, or 503 once the engine has stopped, as vLLM's),
    ``GET /version`` and ``GET /metrics`` (Prometheus' text format); no API key needed."""
    router = APIRouter()
    engine = serving.engine

    @router.get("/health", response_class=Response, responses={
        200: {"description": "the engine is running (no body)"}, 503: {"description": _WHY[503] + " (no body)"},
        500: {"model": ErrorResponse, "description": _WHY[500]}})
    async def health():
        return Response(status_code=200 if engine.is_healthy else 503)

    @router.get("/version", response_model=VersionResponse, responses=errors(500))
    async def version():
        return {"version": version_of_package()}

    @router.get("/metrics", response_class=PrometheusResponse, responses=errors(500))
    async def prometheus_metrics():
        return PrometheusResponse(metrics.exposition(engine.snapshot))

    return router


def version_of_package() -> str:
    """The installed distribution's version (vLLM's ``/version``)."""
    try:
        return importlib.metadata.version("pallas-paged")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _stream(chunks) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream")


async def _unless_disconnected(work, request: Request):
    """Await ``work``, cancelling it (which aborts its requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return Response(status_code=499)
    return task.result()

"""The OpenAI-compatible server: ``python -m engine.serve [--model ...] [--port 8000] ...``.

FastAPI on uvicorn, bound to loopback unless told otherwise. Every error is OpenAI's JSON
shape; no bad request can stop the server or keep a block.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import sys
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.config import DTYPES, EngineConfig
from engine.entrypoints import routes
from engine.entrypoints.async_engine import AsyncLLMEngine, EngineClient
from engine.entrypoints.engine_process import EngineProcess, EngineStartError
from engine.entrypoints.metrics import Metrics
from engine.entrypoints.openai_serving import OpenAIServing
from engine.entrypoints.protocol import RequestError, error_body
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.worker import kv_cache_size
from models import ModelLoadError

log = logging.getLogger("engine.serve")
# The generation-config keys vLLM reads as sampling defaults.
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def error_response(message: str, status: int, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(error_body(message, status, kind), status)


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 before any of it is parsed."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        # Read the whole body here (a chunked one has no length to check), then replay it.
        messages, seen = [], 0
        while not messages or (messages[-1]["type"] == "http.request" and messages[-1].get("more_body")):
            messages.append(await receive())
            seen += len(messages[-1].get("body", b""))
            if seen > self.max_bytes:
                return await self._refuse(scope, receive, send)

        async def replayed():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, scope, receive, send):
        response = error_response(f"request body is larger than {self.max_bytes} bytes", 413)
        await response(scope, receive, send)


def create_app(engine: EngineClient, model_names: list[str], *, api_key: str | None = None,
               max_body_bytes: int = 4 * 2**20, generation_overrides: dict | None = None) -> FastAPI:
    """The FastAPI application serving ``engine`` under ``model_names`` (the first is the
    default). Requests take the model's sampling defaults (``LLMEngine.default_sampling``)
    with ``generation_overrides`` (``--override-generation-config``'s, by generation-config
    names) over them, for the fields they leave out; ``max_new_tokens`` caps every request's
    ``max_tokens`` and is the default of those that send none (else: up to the context)."""
    metrics = Metrics(model_names[0], block_size=engine.engine.config.block_size)
    overrides = {("max_tokens" if key == "max_new_tokens" else key): value
                 for key, value in (generation_overrides or {}).items()}
    serving = OpenAIServing(engine, model_names, on_finished=metrics.observe_finished,
                            defaults={**engine.engine.default_sampling, **overrides})
    app = FastAPI(title="pallas-paged", version=routes.version_of_package(), docs_url=None, redoc_url=None)

    async def authorized(request: Request):
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise RequestError("missing or wrong API key (send 'Authorization: Bearer <key>')", 401,
                               "authentication_error")

    _handle_errors(app)
    app.include_router(routes.generation(serving, authorized))
    app.include_router(routes.tokenizer(serving, authorized))
    app.include_router(routes.operations(serving, metrics))
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.openapi = functools.partial(_openapi, app)
    return app


def _handle_errors(app: FastAPI) -> None:
    """Every error as OpenAI's JSON body; a body FastAPI cannot validate is a 400 (OpenAI's and
    vLLM's status), never FastAPI's 422."""

    @app.exception_handler(RequestError)
    async def request_error(_, error: RequestError):
        return error_response(str(error), error.status, error.kind)

    @app.exception_handler(Exception)
    async def internal_error(_, error: Exception):  # a bug: the client still gets OpenAI's error shape
        return error_response(f"internal error: {error}", 500, "internal_server_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, error: StarletteHTTPException):  # an unknown route, a body that is not UTF-8
        response = error_response(str(error.detail), error.status_code,
                                  "NotFoundError" if error.status_code == 404 else "invalid_request_error")
        response.headers.update(error.headers or {})  # e.g. Allow, on a 405
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, error: RequestValidationError):
        if any(e["type"] == "json_invalid" for e in error.errors()):
            return error_response("the request body is not valid JSON", 400)
        return error_response("; ".join(map(_problem, error.errors())), 400)


def _problem(error: dict) -> str:
    """One of pydantic's validation errors as what to change: the field, then the message
    (without pydantic's "Value error, " for the checks written here)."""
    where = ".".join(str(part) for part in error["loc"] if part != "body")
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema of ``app`` without the 422 it adds to every route with a body: this
    server answers those validation errors with 400, which the routes declare."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation["responses"].pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.serve", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("model_tag", nargs="?", default=None, metavar="MODEL", help="the model, as vLLM's 'vllm serve MODEL' "
        "(or --model)")
    add("--model", default=None, help="HF directory, .gguf file or Hugging Face hub ID, looked up in the local "
        "cache first (default: SmolLM2-135M-Instruct)")
    add("--tokenizer", default=None, help="another tokenizer than the model's (directory, hub ID or .gguf)")
    add("--trust-remote-code", action="store_true", help="accepted; this engine runs no remote code either way")
    add("--served-model-name", nargs="+", default=None, help="names clients use (default: the model's)")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 and the tokenizer routes")
    add("--max-request-bytes", type=int, default=4 * 2**20, help="larger bodies get 413")
    add("--dtype", default="auto", choices=sorted(DTYPES), help="weights (activations are float32); "
        "half/float16 on a GPU only")
    add("--kv-cache-dtype", default="auto", choices=sorted(DTYPES), help="auto: the weights' dtype")
    add("--block-size", type=int, default=16)
    add("--num-blocks", type=int, default=None, help="device KV blocks (default: from --kv-cache-memory)")
    add("--kv-cache-memory", type=int, default=None, help="bytes of device memory for the KV cache (default: "
        "from --gpu-memory-utilization on a GPU or TPU, 1 GiB on a CPU)")
    add("--gpu-memory-utilization", type=float, default=0.9, help="fraction of a GPU's or TPU's memory for the "
        "weights, activations and KV cache (default 0.9)")
    add("--swap-space", type=float, default=4, help="GiB of host memory for swapped-out blocks")
    add("--max-num-seqs", type=int, default=256)
    add("--max-num-batched-tokens", type=int, default=None)
    add("--max-model-len", type=int, default=None)
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
        help="reuse the KV blocks of identical prompt prefixes (default: on)")
    add("--preemption-mode", choices=["recompute", "swap"], default=None)
    add("--seed", type=int, default=0)
    add("--tensor-parallel-size", type=int, default=1, help="split the model over this many devices")
    add("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
        help="dispatch a decode step before the previous one's tokens reach the host (same output, less idle time)")
    add("--num-scheduler-steps", type=int, default=1,
        help="decode steps per dispatch when a step only decodes, sampled on the device (same output; "
             "fewer host round trips, new requests wait up to that many steps)")
    add("--stream-interval", type=int, default=1,
        help="after a stream's first token, send its text every this many tokens (and at its end): "
             "fewer, larger chunks, less work per step with many streams (default 1: every token)")
    add("--enforce-eager", action="store_true", help="skip compiling every step shape at start (each "
        "compiles when first needed); vLLM's switch off CUDA graphs")
    add("--engine-process", action="store_true",
        help="run the engine in a process of its own (vLLM V1's engine core process), so that streaming "
             "hundreds of answers does not slow its steps; for hosts with cores to spare (see docs/gpu.md)")
    add("--disable-log-stats", action="store_true", help="no throughput and cache log line every 10 s")
    add("--max-logprobs", type=int, default=20, help="the most logprobs / top_logprobs / prompt_logprobs a "
        "request may ask for")
    add("--generation-config", choices=["auto", "vllm"], default="auto",
        help="auto: the model's generation_config.json gives the sampling defaults; vllm: ignore it")
    add("--override-generation-config", type=_generation_config, default={}, metavar="JSON",
        help="sampling defaults over the model's, e.g. '{\"temperature\": 0.7, \"max_new_tokens\": 256}' "
             f"(keys: {', '.join(GENERATION_KEYS)}); max_new_tokens also caps every request's max_tokens")
    add("--log-level", default="info")
    return parser


def _generation_config(text: str) -> dict:
    """``--override-generation-config``'s JSON; argparse reports the ValueError."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(config, dict) or set(config) - set(GENERATION_KEYS):
        unknown = sorted(set(config) - set(GENERATION_KEYS)) if isinstance(config, dict) else config
        raise argparse.ArgumentTypeError(f"takes an object with keys among {', '.join(GENERATION_KEYS)}; "
                                         f"got {unknown}")
    try:  # checked as the parameters they become
        SamplingParams(**{("max_tokens" if key == "max_new_tokens" else key): value for key, value in config.items()})
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).replace("SamplingParams.max_tokens", "max_new_tokens")) from None
    return config


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=model_name(args), dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space=args.swap_space, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching, preemption_mode=args.preemption_mode, seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size, async_scheduling=args.async_scheduling,
        num_scheduler_steps=args.num_scheduler_steps, stream_interval=args.stream_interval,
        generation_config=args.generation_config,
        tokenizer=args.tokenizer, trust_remote_code=args.trust_remote_code, enforce_eager=args.enforce_eager,
        disable_log_stats=args.disable_log_stats, max_logprobs=args.max_logprobs)


def model_name(args: argparse.Namespace) -> str | None:
    """The model from ``MODEL`` or ``--model``; ValueError if both are given and differ."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"the model is given twice, as {args.model_tag!r} and --model {args.model!r}; give one")
    return args.model_tag or args.model


async def _serve(server: uvicorn.Server, ready_line: str) -> None:
    async def announce():
        while not server.started:
            await asyncio.sleep(0.05)
        log.info(ready_line)

    watcher = asyncio.create_task(announce())
    await server.serve()
    watcher.cancel()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # Let JAX's GPU allocator hand out what the engine is told it may use (JAX's own default
    # is 0.75 of the device), unless the user chose; it is read when JAX first meets the GPU.
    os.environ.setdefault(kv_cache_size.JAX_GPU_FRACTION, str(args.gpu_memory_utilization))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    try:
        config = engine_config(args)
        engine = EngineProcess(config) if args.engine_process else AsyncLLMEngine(LLMEngine(config))
    except (ModelLoadError, ValueError, EngineStartError) as error:  # what to change, in one line; no traceback
        sys.exit(f"error: {error}")
    names = args.served_model_name or [model_name(args) or DEFAULT_MODEL_NAME]
    app = create_app(engine, names, api_key=args.api_key, max_body_bytes=args.max_request_bytes,
                     generation_overrides=args.override_generation_config)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    ready = (f"ready: serving {names[0]} at http://{args.host}:{args.port}/v1 with "
             f"{engine.engine.kv_capacity_tokens} KV-cache tokens (sized by {engine.engine.kv_cache_size.reason}; "
             f"warm-up {engine.engine.warmup_seconds:.1f} s, start {time.monotonic() - started:.1f} s)")
    try:
        asyncio.run(_serve(uvicorn.Server(config), ready))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()

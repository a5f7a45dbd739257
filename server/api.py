"""The OpenAI-compatible HTTP API on FastAPI.

A route is one module-level function on `router` (a new route is one function); the pooling
endpoints (`/v1/embeddings`, `/score`, `/rerank`, ...) are `server.pooling_api`'s router. What
routes share is the `ServerState` of the app (`request.app.state.server`; `server.serving`:
body intake, admission, answering unless the client left), which `build_app` makes with the
lifespan that starts the engine, the error handlers and the guard middleware.

Every check that can fail a request runs here, before the engine sees it (`server.protocol`
validates the body; tokenization and length checks follow). Errors leave in OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, never with a traceback or a path. Response
bodies are the `server.protocol` models, serialized by pydantic: their JSON shape is defined
there and nowhere else. The engine starts in the background, so `/health` answers 503 until
warmup is done.

Generations (`server.generation`): a chat request whose tool_choice forces a call, or is
"auto" on a server started with a tool call parser (`--enable-auto-tool-choice
--tool-call-parser NAME`), has its output read by a `server.tool_parsers` stream per choice
(after a `--reasoning-parser` took the thinking off): the same stream makes the response's
`tool_calls` and a stream's tool call deltas, which so add up to the same calls.

Shutdown: `ServerState.draining` turns on as soon as the server is told to stop (see
`server.main`); from then on `/health` and new requests answer 503 while the requests already
admitted run to their end.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

import jaxllm
from jaxllm.errors import InputError
from jaxllm.loaders.hf import checkpoint_architectures
from jaxllm.model_files import resolve_model
from server import protocol
from server.anthropic_api import PATH_PREFIX as ANTHROPIC_PATHS
from server.anthropic_api import anthropic_error_body
from server.anthropic_api import router as anthropic_router
from server.config import ServerConfig
from server.generation import (
    Completion,
    chat_generation,
    completion_prompts,
    render_chat,
    sampling_params,
)
from server.lora_api import lora_registry
from server.lora_api import router as lora_router
from server.metrics import Metrics
from server.pooling_api import router as pooling_router
from server.protocol import APIError
from server.reasoning_parsers import REASONING_PARSERS
from server.responses_api import router as responses_router
from server.serving import MAX_BODY_BYTES, ServerState, json_response
from server.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("jaxllm.server")

# What a load balancer, a probe or a scraper reads without the API key; everything else (the
# /v1 API, /tokenize, /detokenize) needs it.
_OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})
# The request line and headers. uvicorn's h11 parser stops buffering an unfinished header
# block at this size (server.main); a block that arrives whole in one read gets past it, so
# the app checks the size too.
MAX_HEADER_BYTES = 64 * 1024


# Families whose output has a reasoning channel of its own, split off without a
# --reasoning-parser, as vLLM always reads gpt-oss's harmony messages.
_BUILT_IN_REASONING = {"GptOssForCausalLM": "openai_gptoss"}


def _built_in_reasoning(engine) -> type | None:
    """The reasoning parser the served model's family implies, or None."""
    load = getattr(getattr(engine, "config", None), "load", None)
    if load is None:
        return None
    try:
        archs = checkpoint_architectures(resolve_model(load.model, download=False)) or []
    except FileNotFoundError:
        return None
    name = next((_BUILT_IN_REASONING[a] for a in archs if a in _BUILT_IN_REASONING), None)
    if name is not None:
        logger.info("reading the model's reasoning with --reasoning-parser %s", name)
    return None if name is None else REASONING_PARSERS[name]


def build_app(start_engine: Callable[[], Any], config: ServerConfig) -> FastAPI:
    """`start_engine` is an async callable returning a ready `AsyncLLM`; `config` names the
    served models (`served_model_name`, which must be given here). The routes are `router`'s."""
    if not config.served_model_name:
        raise ValueError("served_model_name: give the names clients use for the model")
    served_model_names = list(config.served_model_name)
    parser = TOOL_PARSERS[config.tool_call_parser] if config.enable_auto_tool_choice else None
    state = ServerState(served_model_names, config.api_key, config.max_queued_requests, parser)
    if config.reasoning_parser is not None:
        state.reasoning_parser = REASONING_PARSERS[config.reasoning_parser]
    state.enable_sleep_mode = config.enable_sleep_mode
    state.allow_runtime_lora_updating = config.allow_runtime_lora_updating

    async def lifespan(app: FastAPI):
        async def start():
            try:
                state.engine = await start_engine()
                state.loras = lora_registry(state.engine, config, served_model_names[0])
                state.metrics = Metrics(state.engine, served_model_names[0])
                state.engine.on_step = state.metrics.observe
                if config.reasoning_parser is None:
                    state.reasoning_parser = _built_in_reasoning(state.engine)
                ready = state.engine.ready
                logger.info(
                    "engine ready: serving %s (max_model_len %d, %d KV pages of %d tokens, "
                    "%d programs)",
                    ", ".join(served_model_names),
                    ready.max_model_len,
                    ready.num_pages,
                    ready.page_size,
                    ready.num_programs,
                )
            except Exception as e:
                state.startup_error = f"{type(e).__name__}: {e}"
                # server.main then exits non-zero, so a supervisor restarts or reports it
                # rather than finding a server that answers 503 forever.
                logger.error("engine failed to start: %s; shutting down", state.startup_error)

        task = asyncio.create_task(start())
        yield
        state.draining = True
        task.cancel()
        # A core still warming up is stopped by AsyncLLM.create's own cleanup: wait for it.
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if state.engine is not None:
            await state.engine.shutdown()

    app = FastAPI(title="jaxllm", version=jaxllm.__version__, lifespan=lifespan)
    app.state.server = state

    # ---- cross-cutting: errors, auth, header and body size -----------------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc, request)

    @app.exception_handler(InputError)
    async def _input_error(request: Request, exc: InputError):
        return _error_response(APIError.bad_request(str(exc), exc.param), request)

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, _: ClientDisconnect):
        # The client closed its connection before its body arrived whole: no one to answer,
        # and nothing went wrong here (499, as when it leaves while its request runs).
        logger.info("%s: the client left before sending its whole request", request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("internal error")
        return _error_response(APIError.internal(), request)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        header_bytes = sum(len(k) + len(v) + 4 for k, v in request.scope["headers"])  # ": ", CRLF
        if header_bytes > MAX_HEADER_BYTES:
            return _error_response(headers_too_large(MAX_HEADER_BYTES), request)
        if state.api_key is not None and request.url.path not in _OPEN_PATHS:
            # A bearer token, or Anthropic's x-api-key header.
            given = request.headers.get("authorization", "").encode()
            key = request.headers.get("x-api-key", "").encode()
            expected = state.api_key.encode()
            if not (
                hmac.compare_digest(given, b"Bearer " + expected)
                | hmac.compare_digest(key, expected)
            ):
                return _error_response(APIError.unauthorized(), request)
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return _error_response(APIError.too_large(MAX_BODY_BYTES), request)
        return await call_next(request)

    app.include_router(router)
    app.include_router(pooling_router)
    app.include_router(anthropic_router)
    app.include_router(responses_router)
    app.include_router(lora_router)
    return app


# ---- routes: one function each ------------------------------------------------------------

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/health")
async def health(request: Request):
    state = _state(request)
    if state.draining:
        reason = "shutting down"
    elif state.engine is None:
        reason = state.startup_error or "warming up"
    elif state.engine.dead:
        reason = "engine core is dead"
    else:
        return Response(status_code=200)
    return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)


@router.get("/version")
async def version():
    return {"version": jaxllm.__version__}


@router.get("/metrics")
async def metrics(request: Request):
    state = _state(request)
    body = b"" if state.metrics is None else state.metrics.render()  # none until ready
    return Response(body, media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(request: Request):
    state = _state(request)
    max_len = state.engine.max_model_len if state.engine is not None else None
    tasks = state.engine.supported_tasks if state.engine is not None else None
    cards = [
        protocol.ModelCard(
            id=name, created=state.created, max_model_len=max_len, supported_tasks=tasks
        )
        for name in state.served_model_names
    ]
    if state.loras is not None:  # vLLM's cards of adapters: their path and base model
        cards += [
            protocol.ModelCard(
                id=name, created=state.created, max_model_len=max_len, supported_tasks=tasks,
                root=lora.lora_path, parent=state.loras.parents[name],
            )
            for name, lora in state.loras.adapters.items()
        ]  # fmt: skip
    return json_response(protocol.ModelList(data=cards))


def _sleep_mode(state: ServerState):
    if not state.enable_sleep_mode:
        raise APIError.not_found("sleep mode is off (start the server with --enable-sleep-mode)")
    if state.engine is None or state.engine.dead or state.draining:
        raise APIError.unavailable("the engine is not ready")
    return state.engine


@router.post("/sleep")
async def sleep(request: Request, level: int = 1):
    """vLLM's sleep mode (see `ServerConfig.enable_sleep_mode`): only while idle."""
    state = _state(request)
    eng = _sleep_mode(state)
    if level not in (1, 2):
        raise APIError.bad_request(f"level must be 1 or 2, got {level}", "level")
    if state.num_admitted or eng.num_unfinished:
        raise APIError.bad_request(
            f"{state.num_admitted} requests are running: sleep when the server is idle", "level"
        )
    state.sleeping = True
    try:
        await eng.sleep(level)
    except RuntimeError as e:
        state.sleeping = bool(eng.sleep_level)
        raise APIError.unavailable(str(e)) from None
    return Response(status_code=200)


@router.post("/wake_up")
async def wake_up(request: Request):
    state = _state(request)
    eng = _sleep_mode(state)
    try:
        await eng.wake_up()
    except RuntimeError as e:
        raise APIError.unavailable(str(e)) from None
    state.sleeping = False
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(request: Request):
    state = _state(request)
    _sleep_mode(state)
    return {"is_sleeping": bool(state.sleeping or state.engine.sleep_level)}


@router.post("/tokenize")
async def tokenize(request: Request):
    state = _state(request)
    req = await state.parse(request, protocol.TokenizeRequest)
    eng = state.ready_engine()
    state.check_model(req.model)
    if req.messages is not None:
        ids = await state.tokenizing(
            render_chat, eng, req, add_special_tokens=req.add_special_tokens, check_fits=False
        )
    else:
        encode = eng.tokenizer.encode
        ids = await state.tokenizing(encode, req.prompt, add_special_tokens=req.add_special_tokens)
    return json_response(
        protocol.TokenizeResponse(count=len(ids), max_model_len=eng.max_model_len, tokens=ids)
    )


@router.post("/detokenize")
async def detokenize(request: Request):
    state = _state(request)
    req = await state.parse(request, protocol.DetokenizeRequest)
    eng = state.ready_engine()
    state.check_model(req.model)
    eng.input_processor.check_token_ids(req.tokens, "tokens")
    text = await state.tokenizing(eng.tokenizer.decode, req.tokens)
    return json_response(protocol.DetokenizeResponse(prompt=text))


@router.post("/v1/completions")
async def completions(request: Request):
    state = _state(request)
    req = await state.parse(request, protocol.CompletionRequest)
    eng = state.ready_engine("generate", request.url.path)
    model = state.check_model(req.model)

    async def make_gen():
        prompts = await state.tokenizing(completion_prompts, eng, req)
        jobs = [(ids, sampling_params(eng, req, ids, "prompt"), text) for ids, text in prompts]
        return Completion(req, model, jobs, eng, state.lora_request(model))

    return await state.respond(request, state.admit(len(req.prompts()) * req.n), make_gen)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state = _state(request)
    req = await state.parse(request, protocol.ChatCompletionRequest)
    req.check_tool_choice(auto_tool_choice=state.tool_parser is not None)
    eng = state.ready_engine("generate", request.url.path)
    model = state.check_model(req.model)

    async def make_gen():
        return await chat_generation(state, eng, req, model)

    return await state.respond(request, state.admit(req.n), make_gen)


# ---- helpers ----------------------------------------------------------------------------


def headers_too_large(max_bytes: int) -> APIError:
    return APIError(
        431,
        f"The request headers are too large (the limit is {max_bytes} bytes).",
        "RequestHeaderFieldsTooLargeError",
    )


def _error_response(err: APIError, request: Request | None = None) -> JSONResponse:
    """The error in OpenAI's shape, or in Anthropic's on its Messages API's paths."""
    headers = {"Retry-After": "1"} if err.status == 503 else None
    anthropic = request is not None and request.url.path.startswith(ANTHROPIC_PATHS)
    body = anthropic_error_body(err) if anthropic else err.body()
    return JSONResponse(body, status_code=err.status, headers=headers)

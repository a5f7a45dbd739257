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

Tool calls: a chat request whose tool_choice forces a call, or is "auto" on a server started
with a tool call parser (`--enable-auto-tool-choice --tool-call-parser NAME`), has its output
read by a `server.tool_parsers` stream per choice: the same stream makes the response's
`tool_calls` and a stream's tool call deltas, which so add up to the same calls.

Shutdown: `ServerState.draining` turns on as soon as the server is told to stop (see
`server.main`); from then on `/health` and new requests answer 503 while the requests already
admitted run to their end.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

import jinja2
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

import jaxllm
from jaxllm.engine.async_llm import AsyncLLM, RequestFailedError
from jaxllm.engine.core_client import EngineDeadError
from jaxllm.engine.input_processor import InputError
from server import protocol, reasoning_parsers, tool_parsers
from server.config import ServerConfig
from server.metrics import Metrics
from server.pooling_api import router as pooling_router
from server.protocol import APIError
from server.reasoning_parsers import REASONING_PARSERS, ReasoningStream
from server.serving import MAX_BODY_BYTES, ServerState, json_response
from server.tool_parsers import TOOL_PARSERS, ToolCallStream

logger = logging.getLogger("jaxllm.server")

# What a load balancer, a probe or a scraper reads without the API key; everything else (the
# /v1 API, /tokenize, /detokenize) needs it.
_OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})
# The request line and headers. uvicorn's h11 parser stops buffering an unfinished header
# block at this size (server.main); a block that arrives whole in one read gets past it, so
# the app checks the size too.
MAX_HEADER_BYTES = 64 * 1024


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

    async def lifespan(app: FastAPI):
        async def start():
            try:
                state.engine = await start_engine()
                state.metrics = Metrics(state.engine, served_model_names[0])
                state.engine.on_step = state.metrics.observe
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
    async def _api_error(_: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(InputError)
    async def _input_error(_: Request, exc: InputError):
        return _error_response(APIError.bad_request(str(exc), exc.param))

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, _: ClientDisconnect):
        # The client closed its connection before its body arrived whole: no one to answer,
        # and nothing went wrong here (499, as when it leaves while its request runs).
        logger.info("%s: the client left before sending its whole request", request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        logger.exception("internal error")
        return _error_response(APIError.internal())

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        header_bytes = sum(len(k) + len(v) + 4 for k, v in request.scope["headers"])  # ": ", CRLF
        if header_bytes > MAX_HEADER_BYTES:
            return _error_response(headers_too_large(MAX_HEADER_BYTES))
        if state.api_key is not None and request.url.path not in _OPEN_PATHS:
            given = request.headers.get("authorization", "")
            expected = f"Bearer {state.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                return _error_response(APIError.unauthorized())
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return _error_response(APIError.too_large(MAX_BODY_BYTES))
        return await call_next(request)

    app.include_router(router)
    app.include_router(pooling_router)
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
    return json_response(protocol.ModelList(data=cards))


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
        return Completion(req, model, jobs, eng)

    return await state.respond(request, state.admit(len(req.prompts()) * req.n), make_gen)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state = _state(request)
    req = await state.parse(request, protocol.ChatCompletionRequest)
    req.check_tool_choice(auto_tool_choice=state.tool_parser is not None)
    eng = state.ready_engine("generate", request.url.path)
    model = state.check_model(req.model)

    async def make_gen():
        ids = await state.tokenizing(render_chat, eng, req)
        params = sampling_params(eng, req, ids, "messages")
        if req.tool_choice == "auto" and not state.tool_parser.skip_special_tokens:
            params.skip_special_tokens = False  # the parser reads special tokens (vLLM's rule)
        reasoning = None
        if state.reasoning_parser is not None:
            # The end of the prompt says whether the template opened a thinking block, or
            # opened and closed it (thinking off).
            tail = eng.tokenizer.decode(ids[-16:], skip_special_tokens=False)
            opens = reasoning_parsers.prompt_opens_thinking(tail)
            reasoning = functools.partial(state.reasoning_parser, prompt_opens=opens)
            if params.structured_outputs is not None and not (
                reasoning_parsers.prompt_closes_thinking(tail)
            ):
                # Structured outputs (and forced tool calls) constrain the answer only.
                params.reasoning_end_token_id = reasoning_parsers.end_token_id(eng.tokenizer)
        return ChatCompletion(req, model, [(ids, params, None)], eng, state.tool_parser, reasoning)

    return await state.respond(request, state.admit(req.n), make_gen)


# ---- helpers ----------------------------------------------------------------------------


def headers_too_large(max_bytes: int) -> APIError:
    return APIError(
        431,
        f"The request headers are too large (the limit is {max_bytes} bytes).",
        "RequestHeaderFieldsTooLargeError",
    )


def _error_response(err: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if err.status == 503 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


# Characters JSON may carry raw but many line readers split on (str.splitlines, and so httpx's
# aiter_lines): a token decoding to one of them cut a `data:` line in two for such clients.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(body: BaseModel) -> str:
    """One server-sent event; its JSON escapes every character a line reader could break on
    (JSON already escapes the control characters), so each event is one line for any client."""
    return f"data: {body.model_dump_json().translate(_LINE_BREAKS)}\n\n"


def sampling_params(eng: AsyncLLM, req, ids: list[int], param: str):
    """The prompt's and the request's checks (the engine's input path: `InputError`s are
    400s naming the parameter), and the request's `SamplingParams`."""
    room = eng.input_processor.check_prompt(ids, param)
    params = req.to_sampling_params(
        default_max_tokens=room, generation_defaults=eng.generation_config
    )
    eng.input_processor.check_params(params)
    return params


def completion_prompts(eng: AsyncLLM, req) -> list[tuple[list[int], str | None]]:
    """(ids, text) of each prompt; texts that cannot fit are refused before tokenizing."""
    out = []
    for p in req.prompts():
        if isinstance(p, str):
            eng.input_processor.check_text_fits(p, "prompt")
            out.append((eng.tokenizer.encode(p, add_special_tokens=req.add_special_tokens), p))
        else:
            out.append((list(p), None))
    return out


def render_chat(
    eng: AsyncLLM, req, *, add_special_tokens: bool = False, check_fits: bool = True
) -> list[int]:
    try:
        text = eng.tokenizer.apply_chat_template(
            req.conversation(), tokenize=False, **req.template_kwargs()
        )
    except (jinja2.TemplateError, ValueError, TypeError, KeyError):  # the template refused
        raise APIError.bad_request(
            "the chat template rejected these messages", "messages"
        ) from None
    if check_fits:  # /tokenize counts any conversation's tokens
        eng.input_processor.check_text_fits(text, "messages")
    # The template already holds any BOS token, unless the caller asks for one.
    return eng.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _error_event(exc: BaseException) -> str:
    if isinstance(exc, APIError):
        err = exc
    elif isinstance(exc, EngineDeadError | RequestFailedError):
        err = APIError.internal("the engine failed this request")
    else:
        logger.exception("stream failed", exc_info=exc)
        err = APIError.internal()
    return f"data: {json.dumps(err.body())}\n\n"


class _Generation:
    """Runs the n completions of each prompt of one HTTP request, merged in one stream of
    (choice index, snapshot) events. Subclasses build the choices of their endpoint's
    response and stream chunk models."""

    response_cls: ClassVar[type[BaseModel]]
    chunk_cls: ClassVar[type[BaseModel]]

    def __init__(self, req, model: str, jobs, eng: AsyncLLM):
        self.req, self.model, self.jobs, self.eng = req, model, jobs, eng
        self.prompt_logprobs: dict[int, list] = {}  # choice -> the engine's prompt_logprobs
        # The response model's own id form ("cmpl-...", "chatcmpl-..."), one for all chunks.
        self.id = self.response_cls.model_fields["id"].get_default(call_default_factory=True)
        # The engine requests, in choice order: the n completions of each prompt.
        self.requests = [
            request
            for p, (ids, params, _) in enumerate(jobs)
            for request in eng.input_processor.fan_out(f"{self.id}-{p}", ids, params)
        ]
        self.created = int(time.time())
        self.arrival = time.monotonic()

    @property
    def num_requests(self) -> int:
        """Engine requests: n per prompt."""
        return len(self.requests)

    async def _events(self) -> AsyncIterator[tuple[int, Any]]:
        # Bounded: while the client does not read, the choices' tasks wait here, and the
        # engine's outputs pile up as one snapshot per request (AsyncLLM), not one per token.
        queue: asyncio.Queue = asyncio.Queue(maxsize=2 * self.num_requests)

        async def run(choice: int, index: int, request):
            try:
                async for ro in self.eng.generate(request, index=index, arrival_time=self.arrival):
                    if ro.prompt_logprobs is not None:
                        self.prompt_logprobs[choice] = ro.prompt_logprobs
                    await queue.put((choice, ro.outputs[0]))
            except asyncio.CancelledError:
                raise  # the response is over: nobody reads the queue any more
            except Exception as e:
                await queue.put((choice, e))

        tasks = [
            asyncio.create_task(run(choice, index, request))
            for choice, (index, request) in enumerate(self.requests)
        ]
        try:
            done = 0
            while done < len(tasks):
                choice, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    done += 1
                yield choice, item
        finally:
            for t in tasks:
                t.cancel()

    def _job_of(self, choice: int):
        for ids, params, text in self.jobs:
            if choice < params.n:
                return ids, params, text
            choice -= params.n
        raise IndexError(choice)

    def _usage(self, finals: dict[int, Any]) -> protocol.UsageInfo:
        return protocol.UsageInfo.of(
            prompt_tokens=sum(len(ids) for ids, _, _ in self.jobs),
            completion_tokens=sum(len(o.token_ids) for o in finals.values()),
        )

    async def full(self) -> BaseModel:
        finals: dict[int, Any] = {}
        try:
            async with contextlib.aclosing(self._events()) as events:
                async for choice, out in events:
                    if out.finish_reason is not None:
                        finals[choice] = out
        except (EngineDeadError, RequestFailedError):
            raise APIError.internal("the engine failed this request") from None
        return self.response_cls(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[self._choice(c, finals[c]) for c in sorted(finals)],
            usage=self._usage(finals),
        )

    def _chunk(self, choices: list, usage: protocol.UsageInfo | None = None) -> BaseModel:
        return self.chunk_cls(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    async def stream(self) -> AsyncIterator[str]:
        opts = self.req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        sent: dict[int, tuple[int, int]] = {}  # choice -> (chars, tokens) already sent
        finals: dict[int, Any] = {}
        try:
            for chunk in self._stream_start():
                yield _sse(chunk)
            async with contextlib.aclosing(self._events()) as events:
                async for choice, out in events:
                    chars, toks = sent.get(choice, (0, 0))
                    delta = self._delta(choice, out, chars, toks)
                    sent[choice] = (len(out.text), len(out.token_ids))
                    if out.finish_reason is not None:
                        finals[choice] = out
                    if delta is None:
                        continue
                    usage = self._usage({**finals, choice: out}) if continuous else None
                    yield _sse(self._chunk([delta], usage))
            if include_usage:
                yield _sse(self._chunk([], self._usage(finals)))
        except Exception as e:
            yield _error_event(e)
        yield "data: [DONE]\n\n"

    def _stream_start(self) -> list[BaseModel]:
        """The chunks sent before the first token."""
        return []


class Completion(_Generation):
    response_cls = protocol.CompletionResponse
    chunk_cls = protocol.CompletionStreamResponse

    def _logprobs(self, choice: int, out, start_token: int, start_char: int):
        """Logprobs of the tokens from `start_token` on, whose text starts at `start_char`;
        with echo, the first chunk also covers the echoed prompt (its prompt logprobs)."""
        ids, params, _ = self._job_of(choice)
        if params.logprobs is None or out.logprobs is None:
            return None
        token_ids, logprobs = out.token_ids[start_token:], out.logprobs[start_token:]
        if self.req.echo:
            if start_token == 0:
                token_ids = [*ids, *token_ids]
                logprobs = [*self.prompt_logprobs.get(choice, [None] * len(ids)), *logprobs]
            else:
                start_char += len(self._echo(choice))
        return protocol.CompletionLogProbs(
            **protocol.completion_logprobs(
                token_ids,
                logprobs,
                params.logprobs,
                lambda t: self.eng.tokenizer.decode([t]),
                initial_text_offset=start_char,
            )
        )

    def _prompt_logprobs(self, choice: int):
        ids, params, _ = self._job_of(choice)
        if self.req.prompt_logprobs is None or choice not in self.prompt_logprobs:
            return None
        return protocol.prompt_logprobs_json(
            ids, self.prompt_logprobs[choice], self.req.prompt_logprobs
        )

    def _echo(self, choice: int) -> str:
        if not self.req.echo:
            return ""
        ids, _, text = self._job_of(choice)
        return text if text is not None else self.eng.tokenizer.decode(ids)

    def _choice(self, choice: int, out) -> protocol.CompletionResponseChoice:
        return protocol.CompletionResponseChoice(
            index=choice,
            text=self._echo(choice) + out.text,
            logprobs=self._logprobs(choice, out, 0, 0),
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            prompt_logprobs=self._prompt_logprobs(choice),
        )

    def _delta(self, choice: int, out, chars: int, toks: int):
        text = out.text[chars:]
        if toks == 0:
            text = self._echo(choice) + text
        if not text and out.finish_reason is None and len(out.token_ids) == toks:
            return None
        return protocol.CompletionResponseChoice(
            index=choice,
            text=text,
            logprobs=self._logprobs(choice, out, toks, chars),
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            prompt_logprobs=self._prompt_logprobs(choice) if toks == 0 else None,
        )


def tool_call_streams(
    req, parser: type[ToolCallStream] | None
) -> Callable[[], ToolCallStream] | None:
    """What reads the tool calls out of each choice of a chat request: a callable making a
    fresh `ToolCallStream`, or None (the output is content)."""
    if req.named_tool is not None:
        return functools.partial(tool_parsers.NamedToolCall, req.named_tool)
    if req.tool_choice == "required":
        return tool_parsers.RequiredToolCalls
    if req.tool_choice == "auto":  # only on a server with a parser (check_tool_choice)
        return functools.partial(parser, tools=req.tools) if parser.uses_tools else parser
    return None


class ChatCompletion(_Generation):
    response_cls = protocol.ChatCompletionResponse
    chunk_cls = protocol.ChatCompletionStreamResponse

    def __init__(
        self,
        req,
        model: str,
        jobs,
        eng: AsyncLLM,
        tool_parser: type[ToolCallStream] | None,
        reasoning: Callable[[], ReasoningStream] | None = None,
    ):
        """`reasoning`: makes each choice's `ReasoningStream` (a server with a
        --reasoning-parser): the thinking is split off first, and the rest (the answer) is
        what content and tool calls are read from."""
        super().__init__(req, model, jobs, eng)
        self.new_tool_stream = tool_call_streams(req, tool_parser)
        self.tool_streams: dict[int, ToolCallStream] = {}  # choice -> its stream
        self.called: set[int] = set()  # choices that made a tool call so far
        self.new_reasoning_stream = reasoning
        self.reasoning_streams: dict[int, ReasoningStream] = {}
        self.answers: dict[int, str] = {}  # choice -> its answer's text so far

    def _split(self, choice: int, out, *, whole: bool) -> tuple[str, str]:
        """(the reasoning the output adds, the answer's whole text so far); `whole`: a
        non-streamed choice, split at once."""
        if self.new_reasoning_stream is None:
            return "", out.text
        final = out.finish_reason is not None
        if whole:
            d = self.new_reasoning_stream().update(out.text, final=final)
            return d.reasoning, d.content
        stream = self.reasoning_streams.get(choice)
        if stream is None:
            stream = self.reasoning_streams[choice] = self.new_reasoning_stream()
        d = stream.update(out.text, final=final)
        self.answers[choice] = self.answers.get(choice, "") + d.content
        return d.reasoning, self.answers[choice]

    def _reasoning(self, text: str) -> dict:
        """The message's reasoning fields (vLLM's two names), unless the request leaves the
        thinking out."""
        if not text or not self.req.include_reasoning:
            return {}
        return {"reasoning_content": text, "reasoning": text}

    def _tool_delta(self, stream: ToolCallStream, out, text: str) -> tool_parsers.Delta:
        delta = stream.update(text, final=out.finish_reason is not None)
        if not self.req.parallel_tool_calls:  # the first call only (vLLM's rule)
            delta.tool_calls = [c for c in delta.tool_calls if c.index == 0]
        return delta

    def _finish_reason(self, out, called: bool) -> str | None:
        """The engine's finish reason, but "tool_calls" when calls end the output (the engine
        says "stop"), except for a named function, whose call is all the output can be (as in
        vLLM)."""
        if called and out.finish_reason == "stop" and self.req.named_tool is None:
            return "tool_calls"
        return out.finish_reason

    def _message(self, extracted: tool_parsers.Extracted) -> protocol.ChatResponseMessage:
        calls = [
            protocol.ToolCall(
                id=c.id or protocol.tool_call_id(),
                function=protocol.FunctionCall(name=c.name, arguments=c.arguments),
            )
            for c in extracted.tool_calls
        ]
        if self.req.tool_choice != "auto":
            content = ""  # a forced call: no content (vLLM's "")
        else:
            content = extracted.content or (None if calls else "")
        return protocol.ChatResponseMessage(content=content, tool_calls=calls or None)

    @staticmethod
    def _delta_tool_call(call: tool_parsers.ToolCallDelta) -> protocol.DeltaToolCall:
        if call.name is None:
            function = protocol.DeltaFunctionCall(arguments=call.arguments)
            return protocol.DeltaToolCall(index=call.index, function=function)
        return protocol.DeltaToolCall(
            index=call.index,
            id=call.id or protocol.tool_call_id(),
            type="function",
            function=protocol.DeltaFunctionCall(name=call.name, arguments=call.arguments),
        )

    def _logprobs(self, choice: int, out, start_token: int):
        params = self._job_of(choice)[1]
        if params.logprobs is None or out.logprobs is None:
            return None
        return protocol.ChatCompletionLogProbs.model_validate(
            protocol.chat_logprobs(
                out.token_ids[start_token:], out.logprobs[start_token:], params.logprobs
            )
        )

    def _choice(self, choice: int, out) -> protocol.ChatCompletionResponseChoice:
        reasoning, answer = self._split(choice, out, whole=True)
        message = protocol.ChatResponseMessage(content=answer)
        finish_reason = out.finish_reason
        if self.new_tool_stream is not None:
            delta = self._tool_delta(self.new_tool_stream(), out, answer)
            extracted = tool_parsers.assemble([delta])
            message = self._message(extracted)
            finish_reason = self._finish_reason(out, bool(extracted.tool_calls))
        if self.new_reasoning_stream is not None:
            if reasoning and not answer and message.content == "" and not message.tool_calls:
                message.content = None  # all thinking, no answer (vLLM's null content)
            message = message.model_copy(update=self._reasoning(reasoning))
        return protocol.ChatCompletionResponseChoice(
            index=choice,
            message=message,
            logprobs=self._logprobs(choice, out, 0),
            finish_reason=finish_reason,
            stop_reason=out.stop_reason,
        )

    def _stream_start(self) -> list[BaseModel]:
        first = protocol.DeltaMessage(role="assistant", content="")
        n = self.jobs[0][1].n
        return [
            self._chunk(
                [protocol.ChatCompletionStreamChoice(index=i, delta=first) for i in range(n)]
            )
        ]

    def _delta(self, choice: int, out, chars: int, toks: int):
        text, tool_calls, finish_reason = out.text[chars:], None, out.finish_reason
        new_tokens = len(out.token_ids) > toks
        reasoning = ""
        if self.new_reasoning_stream is not None:
            before = len(self.answers.get(choice, ""))
            reasoning, answer = self._split(choice, out, whole=False)
            text = answer[before:]
        else:
            answer = out.text
        if self.new_tool_stream is not None:
            stream = self.tool_streams.get(choice)
            if stream is None:
                stream = self.tool_streams[choice] = self.new_tool_stream()
            delta = self._tool_delta(stream, out, answer)
            text = delta.content
            tool_calls = [self._delta_tool_call(c) for c in delta.tool_calls] or None
            if any(c.name is not None for c in delta.tool_calls):
                self.called.add(choice)
            finish_reason = self._finish_reason(out, choice in self.called)
            # Tokens of a call still being read send nothing, but their logprobs (as vLLM).
            new_tokens = new_tokens and self._job_of(choice)[1].logprobs is not None
        thinking = self._reasoning(reasoning)
        if not text and not tool_calls and not thinking and out.finish_reason is None:
            if not new_tokens:
                return None
        return protocol.ChatCompletionStreamChoice(
            index=choice,
            delta=protocol.DeltaMessage(content=text or None, tool_calls=tool_calls, **thinking),
            logprobs=self._logprobs(choice, out, toks),
            finish_reason=finish_reason,
            stop_reason=out.stop_reason,
        )

"""What every route of the HTTP API builds on: the `ServerState` the routes share (the
engine, the admission count, the server's settings), reading a request's body, admitting its
engine requests, and answering once its work is done, or not at all if its client left.

Intake: a body is read chunk by chunk and refused (413) the moment it passes `MAX_BODY_BYTES`,
whatever its transfer encoding (a `Content-Length` past the cap is refused before any of it is
read). The bodies being read share `MAX_BUFFERED_BODY_BYTES`: a body reserves its length (one of
unknown length, chunked, the whole cap) before its first byte is read, and waits for room
meanwhile (its client is held back by TCP), so concurrent uploads cannot grow the process past
that bound (12 chunked 64 MiB uploads at once grew it by 703 MiB before). JSON parsing, the
surrogate check and validation then run off the event loop.

Admission: a handler checks its engine requests against `--max-queued-requests` before it
tokenizes anything, and counts them in `ServerState.num_admitted` with no await in between; it
gives them back when its response ends, however it ends. (The engine's own count of unfinished
requests moves only once a generation task has started, after the handler returned: a burst of
requests would all see the same count and all get in.) A request of more engine requests than
the queue holds at all (`n`, times its prompts) is a 400: it could never get in.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from jaxllm.engine.async_llm import AsyncLLM
from server import protocol
from server.metrics import Metrics
from server.protocol import APIError
from server.reasoning_parsers import ReasoningStream
from server.tool_parsers import ToolCallStream

MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_BUFFERED_BODY_BYTES = 3 * MAX_BODY_BYTES  # all bodies being read, together
_BODY_ROOM_WAIT_S = 30.0  # how long a body waits for room before a 503

_DISCONNECT_POLL_S = 0.25  # how often a running request checks that its client is there


class ServerState:
    """What the routes share: the engine once it is ready, the admission count, and the
    server's settings. Routes reach it as `request.app.state.server`."""

    def __init__(
        self,
        served_model_names: list[str],
        api_key: str | None,
        max_queued: int,
        tool_parser: type[ToolCallStream] | None = None,
    ):
        self.engine: AsyncLLM | None = None
        self.startup_error: str | None = None
        self.served_model_names = served_model_names
        self.api_key = api_key
        self.max_queued = max_queued
        # What reads the calls of tool_choice "auto"; without one, "auto" is a 400.
        self.tool_parser = tool_parser
        # What splits a reasoning model's thinking off its answer (--reasoning-parser).
        self.reasoning_parser: type[ReasoningStream] | None = None
        self.num_admitted = 0  # engine requests of responses that have not ended yet
        self.draining = False  # set when the server is told to stop; never cleared
        self.engine_died = False  # the engine died while serving: the server exits non-zero
        self.tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-tokenize")
        self.body_room = _ByteBudget(MAX_BUFFERED_BODY_BYTES)
        self.created = int(time.time())
        self.metrics: Metrics | None = None  # once the engine is ready
        # Stored responses of the Responses API (`server.responses_api.ResponseStore`).
        self.responses = None
        self.enable_sleep_mode = False  # --enable-sleep-mode: /sleep and /wake_up served
        # The LoRA adapters served by name (`server.lora_api.LoRARegistry`), with --enable-lora.
        self.loras = None
        self.allow_runtime_lora_updating = False
        self.sleeping = False  # asleep or on the way (new requests get 503 from then on)

    def ready_engine(self, task: str | None = None, endpoint: str | None = None) -> AsyncLLM:
        """The engine, if it is serving; with `task`, only if its model does that task
        (`AsyncLLM.supported_tasks`: a generative model does not embed, an embedding model
        does not generate), else a 400 naming the `endpoint`."""
        if self.draining:
            raise APIError.unavailable("the server is shutting down")
        if self.engine is None or self.engine.dead:
            raise APIError.unavailable("the engine is not ready")
        if self.sleeping or self.engine.sleep_level:
            raise APIError.unavailable("the engine is asleep (sleep mode: POST /wake_up)")
        tasks = self.engine.supported_tasks
        if task is not None and task not in tasks:
            kind = "a pooling model" if self.engine.is_pooling_model else "a generative model"
            raise APIError.bad_request(
                f"{endpoint}: the model {self.served_model_names[0]!r} does not serve this "
                f"endpoint's task ({task!r}); it is {kind}, serving {', '.join(tasks)}",
                "model",
            )
        return self.engine

    def check_model(self, name: str | None, *, adapters: bool = True) -> str:
        """The served model (or LoRA adapter) a request names; 404 for any other. Without
        `adapters` (an endpoint that does not generate), an adapter's name is a 400."""
        if name is None or name in self.served_model_names:
            return self.served_model_names[0] if name is None else name
        if self.loras is not None and name in self.loras.adapters:
            if not adapters:
                raise APIError.bad_request(
                    f"model: {name!r} is a LoRA adapter, which serves generation only", "model"
                )
            return name
        raise APIError.model_not_found(name)

    def lora_request(self, model: str):
        """The LoRA adapter a checked `model` names, or None (the base model); a 404 if the
        adapter was unloaded since the check (never the base model in its place)."""
        if model in self.served_model_names:
            return None
        lora = None if self.loras is None else self.loras.adapters.get(model)
        if lora is None:
            raise APIError.model_not_found(model)
        return lora

    async def tokenizing(self, fn, *args, **kwargs):
        """Tokenizing and templating, off the event loop (a 10 MB prompt takes seconds, and
        `/health` must answer meanwhile), on one thread, so encodes never overlap one another.
        (The output loop decodes on the event loop meanwhile: encode and decode only read the
        tokenizer, which neither reconfigures.)"""
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, call)

    async def parse(self, request: Request, model_cls):
        """The body, read under the cap and the shared bound (see the module's docstring),
        parsed and validated on a worker thread."""
        length = request.headers.get("content-length")
        need = int(length) if length is not None else MAX_BODY_BYTES  # checked by `_guard`
        async with self.body_room.reserve(need, timeout=_BODY_ROOM_WAIT_S):
            body = bytearray()
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise APIError.too_large(MAX_BODY_BYTES)
            return await asyncio.to_thread(_parse_body, body, model_cls)

    def admit(self, n: int, param: str = "n", what: str = "completions") -> Callable[[], None]:
        """Counts `n` engine requests in, or raises (400 naming `param`: more than the queue
        ever holds; 503: the queue is full now); returns what gives them back. `what` the
        requests are, for the message."""
        if n > self.max_queued:
            raise APIError.bad_request(
                f"the request asks for {n} {what}, more than this server queues at once "
                f"({self.max_queued}, --max-queued-requests)",
                param,
            )
        if self.num_admitted + n > self.max_queued:
            raise APIError.unavailable("too many requests are queued; retry later")
        self.num_admitted += n
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.num_admitted -= n

        return release

    async def respond(self, request: Request, admitted: Callable[[], None], make_gen) -> Response:
        """Builds the generation (`make_gen`, awaited: it tokenizes) of admitted requests and
        runs it as a stream or to the end; the admission (`admitted` gives it back) ends with
        the response, however it ends."""
        try:
            gen = await make_gen()
        except BaseException:
            admitted()
            raise
        if gen.req.stream:
            return _EventStream(gen.stream(), on_close=admitted)
        try:
            return await until_done_or_gone(request, gen.full())
        finally:
            admitted()


class _ByteBudget:
    """Bytes shared by the request bodies being read (see the module's docstring)."""

    def __init__(self, total: int):
        self.total = self.free = total
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def reserve(self, n: int, *, timeout: float):
        n = min(n, self.total)
        try:
            async with asyncio.timeout(timeout), self._changed:
                await self._changed.wait_for(lambda: self.free >= n)
                self.free -= n
        except TimeoutError:
            raise APIError.unavailable("the server is reading too many large bodies") from None
        try:
            yield
        finally:
            async with self._changed:
                self.free += n
                self._changed.notify_all()


def _parse_body(body: bytearray, model_cls):
    """A request body as the protocol model `model_cls` (on a worker thread: a large body
    takes the event loop's thread for a while otherwise)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # also integers past 4300 digits
        raise APIError.bad_request("the request body is not valid JSON") from None
    try:  # JSON may escape a lone surrogate ("\ud800"): no tokenizer takes that
        json.dumps(obj, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise APIError.bad_request(
            "the request body holds a lone surrogate (\\ud800-\\udfff), which is not text"
        ) from None
    except RecursionError:
        raise APIError.bad_request("the request body is nested too deeply") from None
    try:
        return protocol.parse_request(model_cls, obj)
    except RecursionError:
        raise APIError.bad_request("the request body is nested too deeply") from None


def json_response(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


async def until_done_or_gone(request: Request, work) -> Response:
    """Runs `work` to its response body, cancelling it (which aborts its requests) if the
    client disconnects."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return json_response(task.result())
            if await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)
    finally:
        if not task.done():
            task.cancel()


class _EventStream(StreamingResponse):
    """A server-sent event stream that closes its events and calls `on_close` when the
    exchange ends, however it ends. The events' own `finally` cannot be trusted with this: a
    client gone before the first chunk leaves the generator unstarted, and one gone while a
    chunk was being sent leaves it suspended until the garbage collector closes it."""

    def __init__(self, events, on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # aborts unfinished engine requests now
            finally:
                self.on_close()

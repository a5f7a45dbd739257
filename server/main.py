"""`jaxllm serve`: the HTTP process (FastAPI on uvicorn) with the engine core as its child.

On SIGTERM or Ctrl-C the app starts draining at once (`/health` and new requests answer 503),
uvicorn stops accepting connections (within 0.1 s), lets in-flight requests finish for up to
`--shutdown-timeout` seconds, then the app's shutdown stops the core process, so nothing is
left running.

HTTP/1.1 is parsed by h11 whatever else is installed (uvicorn's "auto" would take httptools):
the header block limit is an h11 setting.
"""

from __future__ import annotations

import json
import logging
import sys
from http import HTTPStatus
from pathlib import Path

import h11
import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxllm.config import EngineConfig
from jaxllm.engine.async_llm import AsyncLLM
from server.api import MAX_HEADER_BYTES, build_app, headers_too_large
from server.config import ServerConfig
from server.protocol import APIError
from server.serving import ServerState

logger = logging.getLogger("jaxllm.server")

_LINGER_S = 2.0  # how long a refused request may go on sending before its connection closes


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app the moment a shutdown signal arrives. uvicorn itself
    acts on the signal at its next tick (up to 0.1 s later, still serving new requests until
    then) and the app's lifespan hears of the shutdown only after the drain."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        self.state.draining = True
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.state.startup_error is not None:  # the engine could not start: stop serving
            return True
        engine = self.state.engine
        if engine is not None and engine.dead and not self.state.draining:
            # The engine core died (or its outputs could not be processed): its requests have
            # failed already. Exit non-zero, so a supervisor restarts the server, rather than
            # answer 503 forever (vLLM's server exits too).
            logger.error("the engine is dead; the server exits")
            self.state.engine_died = True
            self.state.draining = True
            return True
        return await super().on_tick(counter)


class _H11Protocol(H11Protocol):
    """uvicorn's h11 protocol, changed for requests h11 cannot parse; in practice a header
    block past h11_max_incomplete_event_size. uvicorn answers those 400 in plain text and
    closes at once; here:
    - the status is h11's hint (431 for a header block too large) and the body is in OpenAI's
      error shape;
    - the connection closes once the client has stopped sending, or after _LINGER_S: closing
      with request bytes still unread makes the kernel reset the connection, and the client
      would never read the answer."""

    _refused = False

    def data_received(self, data: bytes) -> None:
        if not self._refused:  # after the answer, the rest of the request is dropped unread
            super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this from its `except h11.RemoteProtocolError` block.
        status = getattr(sys.exc_info()[1], "error_status_hint", 400)
        if status == 431:
            err = headers_too_large(MAX_HEADER_BYTES)
        else:
            err = APIError.bad_request(msg)
        body = json.dumps(err.body(), separators=(",", ":")).encode()  # as JSONResponse writes
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        reason = HTTPStatus(err.status).phrase.encode()
        for event in (
            h11.Response(status_code=err.status, headers=headers, reason=reason),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self._refused = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(_LINGER_S, self.transport.close)


def _load_generation_config(option: str, model_defaults: dict) -> dict:
    if option == "auto":
        return model_defaults
    if option == "vllm":
        return {}
    path = Path(option) / "generation_config.json"
    if not path.is_file():
        raise ValueError(f"--generation-config: {path} does not exist")
    return json.loads(path.read_text())


def _load_chat_template(option: str | None) -> str | None:
    if option is None:
        return None
    path = Path(option)
    if len(option) < 4096 and path.is_file():
        return path.read_text()
    if "{" not in option:
        raise ValueError(f"--chat-template: {option!r} is neither a file nor a template")
    return option


def serve(config: EngineConfig, server_config: ServerConfig) -> int:
    """Serves until told to stop; the exit code (non-zero when the engine could not start or
    died). `server_config.served_model_name` must be resolved (`server.cli` does)."""
    template = _load_chat_template(server_config.chat_template)

    async def start_engine() -> AsyncLLM:
        engine = await AsyncLLM.create(config)
        if template is not None:
            engine.tokenizer.chat_template = template
        engine.generation_config = _load_generation_config(
            server_config.generation_config, engine.generation_config
        )
        return engine

    app = build_app(start_engine, server_config)
    uv_config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level="info",
        http=_H11Protocol,
        timeout_graceful_shutdown=server_config.shutdown_timeout,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    server = _Server(uv_config, app.state.server)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it stopped on
        pass
    if app.state.server.startup_error is not None or app.state.server.engine_died:
        return 1  # the engine could not start, or died (the reason is logged)
    return 0 if server.started else STARTUP_FAILURE

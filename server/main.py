"""`jaxllm serve`: the HTTP process (FastAPI on uvicorn) with the engine core as its child.

On SIGTERM or Ctrl-C uvicorn stops accepting connections, lets in-flight requests finish for
up to `shutdown_timeout` seconds, then the app's shutdown stops the core process, so nothing
is left running.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import uvicorn

from jaxllm.engine.async_llm import AsyncLLM
from server.api import build_app

logger = logging.getLogger("jaxllm.server")


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


def serve(
    model: str,
    engine_kwargs: dict,
    *,
    host: str,
    port: int,
    api_key: str | None,
    served_model_names: list[str],
    max_queued_requests: int,
    chat_template: str | None,
    generation_config: str,
    shutdown_timeout: float,
) -> int:
    template = _load_chat_template(chat_template)

    async def start_engine() -> AsyncLLM:
        engine = await AsyncLLM.create(model, **engine_kwargs)
        if template is not None:
            engine.tokenizer.chat_template = template
        engine.generation_config = _load_generation_config(
            generation_config, engine.generation_config
        )
        return engine

    app = build_app(
        start_engine,
        served_model_names=served_model_names,
        api_key=api_key,
        max_queued_requests=max_queued_requests,
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="info",
        timeout_graceful_shutdown=shutdown_timeout,
        h11_max_incomplete_event_size=64 * 1024,  # header block limit
    )
    return 0

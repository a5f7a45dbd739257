"""LoRA adapters over HTTP, as vLLM serves them (with `--enable-lora`): `--lora-modules` names
adapters at startup, a request's `model` field picks one (`/v1/models` lists them with their
parent), and with `--allow-runtime-lora-updating` (vLLM's environment switch, a flag here)
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` change them while serving.

The front end keeps the names (`LoRARegistry`); an adapter's files are checked when it is
named (read here, against the model's config.json where the model has one) and read again by
the engine core when a request first uses it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from jaxllm.lora import BaseDims, LoRARequest, load_adapter
from server.protocol import APIError

logger = logging.getLogger("jaxllm.server")
router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON form `{"name": ..., "path":
    ..., "base_model_name": ...}`: (name, path, base model name or None)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            entry = json.loads(text)
            return entry["name"], entry["path"], entry.get("base_model_name")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"--lora-modules: {text!r} is not {{'name': ..., 'path': ...}} JSON ({e})"
            ) from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {text!r} is not name=path")
    return name, path, None


class LoRARegistry:
    """The adapters a server serves, by name: each a `LoRARequest` with an id of its own (an
    adapter loaded again under its old name is a new adapter to the engine)."""

    def __init__(self, model: str, max_rank: int, base_name: str):
        self.max_rank = max_rank
        self.base_name = base_name
        self.adapters: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}
        self._ids = itertools.count(1)
        config = Path(model) / "config.json"
        self.dims = (
            BaseDims.of_hf_config(json.loads(config.read_text())) if config.is_file() else None
        )

    def check(self, path: str) -> None:
        """Reads the adapter at `path` as the engine will; ValueError naming what is wrong. A
        GGUF model has no config.json: its shapes are checked by the engine at first use."""
        load_adapter(path, self.dims, max_rank=self.max_rank)

    def add(self, name: str, path: str, parent: str | None = None) -> LoRARequest:
        """Serves the adapter at `path` (checked already: `check`) as `name`."""
        if name in self.adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        lora = self.adapters[name] = LoRARequest(name, next(self._ids), str(Path(path).resolve()))
        self.parents[name] = parent or self.base_name
        return lora

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(name)
        del self.adapters[name]
        del self.parents[name]


def lora_registry(engine, config, base_name: str) -> LoRARegistry | None:
    """The adapters of a server whose engine serves LoRA, with `--lora-modules` read and
    checked (a ValueError naming the entry fails the start); None without LoRA."""
    from jaxllm.model_files import resolve_model

    lora = engine.config.lora
    if not lora.enable_lora:
        return None
    registry = LoRARegistry(
        str(resolve_model(engine.config.load.model)), lora.max_lora_rank, base_name
    )
    for entry in config.lora_modules or ():
        name, path, parent = parse_lora_module(entry)
        registry.check(path)
        registry.add(name, path, parent)
    return registry


def _registry(request: Request) -> LoRARegistry:
    state = request.app.state.server
    if state.loras is None or not state.allow_runtime_lora_updating:
        raise APIError.not_found(
            "runtime LoRA updating is off (start the server with --enable-lora and "
            "--allow-runtime-lora-updating)"
        )
    return state.loras


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request):
    state = request.app.state.server
    req = await state.parse(request, LoadLoRAAdapterRequest)
    loras = _registry(request)
    if req.lora_name in state.served_model_names:
        raise APIError.bad_request(f"lora_name {req.lora_name!r} is the base model's", "lora_name")
    if req.lora_name in loras.adapters:  # before reading files; `add` checks it again
        raise APIError.bad_request(
            f"The lora adapter '{req.lora_name}' has already been loaded.", "lora_name"
        )
    try:
        await asyncio.to_thread(loras.check, req.lora_path)  # reads files: off the loop
    except (ValueError, OSError) as e:
        raise APIError.bad_request(f"lora_path: {e}", "lora_path") from None
    try:
        loras.add(req.lora_name, req.lora_path)
    except ValueError as e:
        raise APIError.bad_request(str(e), "lora_name") from None
    logger.info("loaded LoRA adapter %s from %s", req.lora_name, req.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    state = request.app.state.server
    req = await state.parse(request, UnloadLoRAAdapterRequest)
    loras = _registry(request)
    try:
        loras.remove(req.lora_name)
    except KeyError:
        raise APIError.not_found(
            f"The lora adapter '{req.lora_name}' cannot be found.", "lora_name"
        ) from None
    logger.info("unloaded LoRA adapter %s", req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

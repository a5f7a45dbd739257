"""`jaxllm serve`: the server registers this subcommand with the `jaxllm` command line (the
`jaxllm.commands` entry point in pyproject.toml), so the engine's CLI does not import the
server."""

from __future__ import annotations

import argparse
import dataclasses
import os

from jaxllm.config import EngineConfig, add_cli_args, add_dataclass_args, from_cli_args
from server.config import ServerConfig


def add_command(subparsers) -> None:
    """Adds `serve` to the `jaxllm` command line's subcommands."""
    srv = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_cli_args(srv)
    add_dataclass_args(srv, ServerConfig)
    srv.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from jaxllm.cli import multihost_worker
    from server.main import serve

    engine_config = EngineConfig.from_cli(args)
    config = from_cli_args(ServerConfig, args)
    config = dataclasses.replace(
        config,
        api_key=config.api_key or os.environ.get("JAXLLM_API_KEY") or None,
        served_model_name=config.served_model_name or (str(args.model),),
    )
    if (config.lora_modules or config.allow_runtime_lora_updating) and not (
        engine_config.lora.enable_lora
    ):
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    if config.headless:  # another host's data-parallel ranks: engine cores, no HTTP
        from jaxllm.engine.dp_client import run_headless

        return run_headless(engine_config)
    worker = multihost_worker(engine_config)  # hosts other than 0 serve no HTTP
    if worker is not None:
        return worker
    return serve(engine_config, config)

"""`jaxllm bench`: `serve` (a load generator against a running OpenAI-compatible server),
`throughput` and `latency` (the engine offline, through `LLM`), with `vllm bench`'s
subcommands and flag names. Each module adds its flags (`add_cli_args`) and runs a parsed
command line (`run`); the scripts in benchmarks/ build on the same functions."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json(path: str, res: dict[str, Any]) -> None:
    """Writes a result as indented JSON to `path`, creating its directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=2, default=str)
        f.write("\n")
    print(f"wrote {path}")

"""`jaxllm bench`: `serve` (a load generator against a running OpenAI-compatible server),
`throughput` and `latency` (the engine offline, through `LLM`), with `vllm bench`'s
subcommands and flag names. Each module adds its flags (`add_cli_args`) and runs a parsed
command line (`run`); the scripts in benchmarks/ build on the same functions."""

from __future__ import annotations

import json
import os
import platform
from typing import Any


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), for results measured on it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_json(path: str, res: dict[str, Any]) -> None:
    """Writes a result as indented JSON to `path`, creating its directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=2, default=str)
        f.write("\n")
    print(f"wrote {path}")

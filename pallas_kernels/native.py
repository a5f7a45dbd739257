"""Native CPU kernels: C++ sources under `cpu/`, compiled on first use with the machine's
compiler for its own CPU (`-march=native`) and called from jitted steps through the XLA FFI.

Each library is cached under `$JAXLLM_CACHE_DIR/kernels` (default `~/.cache/jaxllm/kernels`),
keyed by the source, the flags, jaxlib's version and the CPU's feature flags, so a cache shared
between different machines never hands one a binary built for another. Building takes a few
seconds, once. Where no C++ compiler is found, or the build fails, `load` returns the reason
(and logs it) and callers fall back to plain XLA.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

_SOURCES = Path(__file__).parent / "cpu"
# -ffast-math lets the compiler vectorize the sums and exp; the kernels never rely on inf or
# NaN (masked scores are a finite -1e30, and unused slots are never read). It is a compile
# flag only: linked with it, GCC (before 13) adds crtfastmath.o, whose constructor turns on
# flush-to-zero and denormals-are-zero for the whole process the moment the library loads
# (every numpy and XLA computation then loses its subnormals).
# -fopenmp for the `omp simd` hints only: the kernels' threads are XLA's (cpu/parallel.h).
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC"]
_LINK_FLAGS = ["-shared", "-fopenmp", "-fPIC"]


def _cache_dir() -> Path:
    # The rule of jaxllm.model_files.cache_dir, restated: pallas_kernels does not import jaxllm.
    base = os.environ.get("JAXLLM_CACHE_DIR") or Path.home() / ".cache" / "jaxllm"
    return Path(base) / "kernels"


def _cpu_signature() -> str:
    """What a binary depends on besides its source: the CPU's features and the ABI."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    import jaxlib

    return f"{platform.machine()}|{flags}|jaxlib {jaxlib.__version__}"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(name: str, extra_flags: tuple[str, ...] = (), sources: Path = _SOURCES) -> Path:
    """The compiled library of `cpu/<name>.cc`, building it if it is not cached yet.
    `extra_flags` follow `-march=native`: the tests build a kernel's other variants with them
    (`-mno-avx512f` takes away what an older CPU lacks). `sources`: another directory holding
    `<name>.cc` and its headers (a benchmark builds a kernel's source at an older revision)."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    source_path = sources / f"{name}.cc"
    # The key covers the headers beside the sources too (shared code such as e4m3.h).
    source = source_path.read_bytes() + b"".join(
        h.read_bytes() for h in sorted(sources.glob("*.h"))
    )
    flags = [*_FLAGS, *extra_flags]
    key = hashlib.sha256(
        source + " ".join([cxx, *flags, *_LINK_FLAGS]).encode() + _cpu_signature().encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"{name}_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        obj = Path(tmp) / f"{name}.o"
        include = f"-I{jax.ffi.include_dir()}"
        for cmd in (
            [cxx, *flags, include, "-c", str(source_path), "-o", str(obj)],
            [cxx, *_LINK_FLAGS, str(obj), "-o", str(tmp_out)],
        ):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"building {source_path.name} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp_out, out)  # atomic: concurrent builders each write their own temp file
    logger.info("built the CPU kernel %s: %s", name, out)
    return out


@functools.cache
def library(name: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """`cpu/<name>.cc` built (see `_build`) and loaded, once per process."""
    return ctypes.cdll.LoadLibrary(str(_build(name, extra_flags)))


@functools.cache
def load(name: str, symbol: str, target: str, extra_flags: tuple[str, ...] = ()) -> str | None:
    """Builds `cpu/<name>.cc`, loads it and registers its handler `symbol` as the FFI target
    `target`, once per process; None when that worked, else the reason (also logged)."""
    try:
        lib = library(name, extra_flags)
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except Exception as e:  # no compiler, a failed build, a library that will not load
        logger.warning("the native CPU kernel %s is unavailable (%s); using XLA", name, e)
        return str(e)
    return None

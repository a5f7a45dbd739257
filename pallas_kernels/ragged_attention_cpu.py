"""Ragged paged attention as a native CPU kernel (`cpu/ragged_attention.cc`), through the XLA FFI.

The kernel is C++ compiled on first use with the machine's compiler, for its own CPU
(`-march=native`), and cached under `$JAXLLM_CACHE_DIR/kernels` (default
`~/.cache/jaxllm/kernels`), keyed by the source, the flags, jaxlib's version and the CPU's
feature flags, so a cache shared between different machines never hands one a binary built
for another. Building takes a few seconds, once. Where no C++ compiler is found, or the build
fails, `available()` is False (the reason is logged) and `resolve_backend("auto")` uses the
`xla` backend instead.

Why C++ here when the accelerators get Pallas: Pallas runs on a CPU only in interpret mode,
and attention written with XLA ops copies and transposes the gathered pages for matmuls that
XLA's CPU backend runs slowly at these shapes (see the .cc file's header). JAX's FFI is the
supported way to add such an op; the call is a custom call inside the same jitted step, reads
the KV cache in place (no copy: checked by the runner's in-place test), and runs on the
step's own threads (OpenMP inside the call).

The sliding window is an operand of the call (i32[1], <= 0: none), not an attribute, so a
traced window (a layer scan's) works; the kernel still reads no token before a work item's
window.
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
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "cpu" / "ragged_attention.cc"
_TARGET = "jaxllm_ragged_paged_attention"
_SYMBOL = "JaxllmRaggedPagedAttention"
# -ffast-math lets the compiler vectorize the sums and exp; the kernel never relies on inf or
# NaN (masked scores are a finite -1e30, and unused slots are never read). It is a compile
# flag only: linked with it, GCC (before 13) adds crtfastmath.o, whose constructor turns on
# flush-to-zero and denormals-are-zero for the whole process the moment the library loads
# (every numpy and XLA computation then loses its subnormals).
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC"]
_LINK_FLAGS = ["-shared", "-fopenmp", "-fPIC"]


def _cache_dir() -> Path:
    # The rule of jaxllm.model_cache.cache_dir, restated: pallas_kernels does not import jaxllm.
    base = os.environ.get("JAXLLM_CACHE_DIR") or Path.home() / ".cache" / "jaxllm"
    return Path(base) / "kernels"


def _cpu_signature() -> str:
    """What the binary depends on besides its source: the CPU's features and the ABI."""
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


def _build() -> Path:
    """The compiled kernel library, building it if it is not cached yet."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        source + " ".join([cxx, *_FLAGS, *_LINK_FLAGS]).encode() + _cpu_signature().encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"ragged_attention_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        obj = Path(tmp) / "ragged_attention.o"
        include = f"-I{jax.ffi.include_dir()}"
        for cmd in (
            [cxx, *_FLAGS, include, "-c", str(_SOURCE), "-o", str(obj)],
            [cxx, *_LINK_FLAGS, str(obj), "-o", str(tmp_out)],
        ):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"building the CPU attention kernel failed:\n{proc.stderr[-2000:]}"
                )
        os.replace(tmp_out, out)  # atomic: concurrent builders each write their own temp file
    logger.info("built the CPU attention kernel: %s", out)
    return out


@functools.cache
def _load() -> str | None:
    """Builds, loads and registers the kernel once per process; None (and a logged reason)
    when it cannot be had."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
        jax.ffi.register_ffi_target(
            _TARGET, jax.ffi.pycapsule(getattr(lib, _SYMBOL)), platform="cpu"
        )
    except Exception as e:  # no compiler, a failed build, a library that will not load
        logger.warning("the native CPU attention kernel is unavailable (%s); using `xla`", e)
        return str(e)
    return None


def available() -> bool:
    """Whether the kernel could be built and registered (builds it on the first call)."""
    return _load() is None


def ragged_paged_attention_cpu(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [L, num_pages, page_size, 2K, H]
    layer: jax.Array | int,  # i32[]
    seq_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, P]
    cu_q_lens: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: jax.Array,  # i32[]  keys a query sees back from itself; <= 0: all
    soft_cap: float | None = None,
) -> jax.Array:  # [T, N, H]
    if q.dtype != kv_cache.dtype or q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(
            f"the cpu backend needs q and kv_cache both float32 or both bfloat16, got {q.dtype} "
            f"and {kv_cache.dtype}"
        )
    error = _load()
    if error is not None:
        raise RuntimeError(f"the cpu attention backend is unavailable: {error}")
    i32 = jnp.int32
    return jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))(
        q,
        kv_cache,
        jnp.asarray(layer, i32).reshape(1),
        seq_lens.astype(i32),
        block_tables.astype(i32),
        cu_q_lens.astype(i32),
        num_seqs.astype(i32),
        jnp.asarray(sliding_window, i32).reshape(1),
        sm_scale=np.float32(sm_scale),
        soft_cap=np.float32(soft_cap or 0.0),
    )

"""JAX's persistent compilation cache, on by default so that a restart loads the compiled
bucket programs from disk instead of compiling them again.

The cache directory is trusted code (JAX executes what it loads), so it lives under the
user's own cache directory with owner-only permissions; never point it at a directory that
others can write.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as cc

logger = logging.getLogger(__name__)

_current: str | None = None


def setup_compilation_cache(path: str | os.PathLike | None) -> None:
    """Points JAX's persistent cache at `path` (None or "" leaves it as it is)."""
    global _current
    if not path:
        return
    path = str(Path(path).expanduser())
    if path == _current:
        return
    Path(path).mkdir(parents=True, exist_ok=True, mode=0o700)
    jax.config.update("jax_compilation_cache_dir", path)
    # Cache every step program, even fast-compiling ones (tiny models, small buckets).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # JAX reads the setting when it first compiles; start over so it applies even when
    # something was compiled already in this process.
    cc.reset_cache()
    _current = path
    logger.info("persistent compilation cache: %s", path)

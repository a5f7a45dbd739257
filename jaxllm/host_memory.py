"""glibc malloc settings that keep XLA's CPU temporaries resident between engine steps.

On the CPU backend XLA allocates a step's temporaries with malloc, from its worker threads,
and frees them after the step. With glibc's defaults each thread has an arena of its own, a
temporary too large for its arena's heap gets a new mmapped heap that is unmapped again when
freed, and large blocks are mapped on their own, so every step maps fresh pages and takes a
page fault on the first touch of each 4 KiB. Measured on the 2-core CPU: writing a [64, 49152]
float32 array (64 rows of logits) and taking its argmax cost 17-22 ms per call with the
defaults against 4-6 ms with `TUNABLES`; the demo model's batch-1 decode step 28.5 ms against
26.6 ms.

`TUNABLES` puts every thread on the main heap (one arena), serves blocks up to 32 MiB from it,
does not trim it (freed blocks stay resident for the next step, as jemalloc or tcmalloc keep
them) and maps nothing on its own (`mmap_max=0`): larger blocks come from the heap too. The
32 MiB is glibc's ceiling for `mmap_threshold`, and XLA:CPU allocates a program's temporaries
as one block: a step whose temporaries pass 32 MiB (the head and sampler over [64, 49152]
logits: 72 MiB with the sampler's optional branches) got a fresh mapping every call and a page
fault on each page it touched. Measured on the 2-core CPU, a [R, 64] x [64, 49152] head and
greedy sampler: 31.7 against 12.9 ms at R = 64, 132 against 36 ms at R = 256
(`benchmarks/sampler_step.py`); the demo model at batch 8 the same within noise (10.5-11.4 s
per `jaxllm bench latency` iteration either way, the same 2.8 GB peak RSS). The cost: memory
freed inside the heap stays with the process (it is reused, not returned), which the trim
setting already chose for the step's temporaries.

glibc reads GLIBC_TUNABLES once, when a process starts (`mallopt` from a running process came
too late for threads that already had arenas), so `set_for_children` puts it in the
environment the engine's core process is spawned with. A process that runs the engine itself
(`LLM` in a script) gets it from its caller's environment:

    GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4000000000:glibc.malloc.mmap_max=0 python script.py

Only where JAX can only run on the CPU: an accelerator's steps allocate on the device.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform

TUNABLES = (
    "glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold=33554432"
    ":glibc.malloc.trim_threshold=4000000000:glibc.malloc.mmap_max=0"
)


def glibc() -> bool:
    """Whether this process runs on Linux with glibc (where the tunables mean anything)."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def cpu_only() -> bool:
    """Whether JAX can only run on the CPU here, decided without starting it."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",") == ["cpu"]
    plugins = importlib.metadata.entry_points(group="jax_plugins")
    return not plugins and importlib.util.find_spec("libtpu") is None


def set_for_children() -> bool:
    """Adds `TUNABLES` to GLIBC_TUNABLES in this process's environment, for the processes it
    starts, on a glibc Linux where JAX can only run on the CPU and no malloc tunable is set
    yet. Returns whether it did."""
    current = os.environ.get("GLIBC_TUNABLES", "")
    if not glibc() or "glibc.malloc." in current or not cpu_only():
        return False
    os.environ["GLIBC_TUNABLES"] = f"{current}:{TUNABLES}" if current else TUNABLES
    return True

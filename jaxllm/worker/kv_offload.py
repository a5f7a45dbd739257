"""The host-RAM KV tier's copies (vLLM's `--kv-offloading-size`): full blocks evicted from the
device's prefix cache go to host memory, and come back into fresh device blocks when a
request's prefix hits them there (the books: `jaxllm.engine.host_blocks.HostBlockPool`).

Each step's copies run before its programs, in the order that keeps them right when a block
or slot changes hands within the step:
1. the previous steps' stores land in host memory (their device-to-host copies were started
   when they were dispatched, so by now they have arrived);
2. this step's stores: one program gathers the evicted blocks of every layer into one array
   (before anything overwrites them), whose copy to the host starts at once and is not waited
   for: off the step's critical path;
3. this step's loads: the host slots' data (read now, before any store lands in them) is
   scattered into the donated cache, in place;
4. the step's forward pass, which may read the loaded blocks.

The copies go in chunks of a few fixed sizes, each a program compiled at warmup: nothing
compiles while serving. Under tensor parallelism every device's shard of a block travels (the
host keeps whole blocks); an 8-bit cache's scales travel with its data.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.worker.compiler import Compiler
from jaxllm.worker.device_state import DeviceState
from jaxllm.worker.features import Feature, Warmup
from jaxllm.worker.step_data import SchedulerOutput
from pallas_kernels import KVCache

CHUNKS = (1, 4, 16, 64)  # blocks per copy program


def _gather(cache: KVCache, pages: jax.Array) -> list[jax.Array]:
    """Blocks `pages` of every layer, block-major: [n, L, ...] per array of the cache."""
    return [jnp.moveaxis(a[:, pages], 1, 0) for a in cache if a is not None]


def _scatter(cache: KVCache, pages: jax.Array, blocks: list[jax.Array]) -> KVCache:
    """`blocks` ([n, L, ...] per array) written into blocks `pages` (out of range: dropped)."""
    arrays = iter(blocks)
    return KVCache(
        *(
            None if a is None else a.at[:, pages].set(jnp.moveaxis(next(arrays), 0, 1), mode="drop")
            for a in cache
        )
    )


class KVOffloader(Feature):
    def __init__(self, device: DeviceState, compiler: Compiler, num_host_blocks: int):
        self.device = device
        self.compiler = compiler
        self.num_pages = device.kv_cache.shape[1]
        # Host memory for `num_host_blocks` blocks, per array of the cache: [slot, L, ...].
        self.host = [
            np.zeros((num_host_blocks, a.shape[0], *a.shape[2:]), a.dtype)
            for a in device.kv_cache
            if a is not None
        ]
        self._gather = jax.jit(_gather)
        self._scatter = jax.jit(_scatter, donate_argnums=(0,))
        self._pending: list[tuple[list[int], list[jax.Array]]] = []  # stores under way

    @property
    def host_bytes(self) -> int:
        return sum(h.nbytes for h in self.host)

    def warmup_jobs(self, warm: Warmup) -> list:
        """A gather and a scatter program per chunk size."""

        def compile_chunk(n: int):
            pages = np.zeros(n, np.int32)
            blocks = [np.zeros((n, *h.shape[1:]), h.dtype) for h in self.host]
            cache = self.device.kv_cache
            self.compiler.compile("kv_offload_store", (n,), self._gather, cache, pages)
            self.compiler.compile(
                "kv_offload_load", (n,), self._scatter, cache, pages, blocks, updates_cache=True
            )

        return [functools.partial(compile_chunk, n) for n in CHUNKS]

    @property
    def num_programs(self) -> int:
        return 2 * len(CHUNKS)

    def before_forward(self, out: SchedulerOutput) -> None:
        """Runs a step's copies before its programs (see the module doc)."""
        self.launch(out.kv_stores, out.kv_loads)

    def launch(self, stores: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """Stores blocks to host memory and loads blocks back (see the module doc)."""
        self.land()
        for pairs in _chunks(stores):
            blocks, slots = zip(*pairs, strict=True)
            pages = _padded(blocks, 0)  # padding gathers block 0, never stored
            gathered = self._gather(self.device.kv_cache, pages)
            for a in gathered:
                a.copy_to_host_async()
            self._pending.append((list(slots), gathered))
        for pairs in _chunks(loads):
            slots, blocks = zip(*pairs, strict=True)
            rows = _padded(slots, 0)
            pages = _padded(blocks, self.num_pages)  # padding: out of range, dropped
            data = [h[rows] for h in self.host]  # copies: a later store may reuse the slots
            self.device.kv_cache = self._scatter(self.device.kv_cache, pages, data)

    def read(self, pages: list[int]) -> list[np.ndarray]:
        """Device blocks `pages` of every layer as host arrays, [n, L, ...] per array of the
        cache (a decoder's pull, `jaxllm.engine.kv_transfer`). Waits for them: the steps in
        flight run first."""
        parts = []
        for chunk in _chunks(list(pages)):
            gathered = self._gather(self.device.kv_cache, _padded(chunk, 0))
            parts.append([np.asarray(a)[: len(chunk)] for a in gathered])
        return [
            np.concatenate([p[k] for p in parts]) if parts else np.zeros((0, *h.shape[1:]), h.dtype)
            for k, h in enumerate(self.host)
        ]

    def write(self, slots: list[int], blocks: list[np.ndarray]) -> None:
        """Writes blocks ([n, L, ...] per array of the cache) into host slots `slots`, after
        the stores under way (which could otherwise land on them later)."""
        self.land()
        if slots:
            for h, b in zip(self.host, blocks, strict=True):
                h[slots] = b

    def land(self) -> None:
        """Writes the stores under way into host memory, in the order they were made (a slot
        stored twice keeps the later block)."""
        for slots, gathered in self._pending:
            for h, a in zip(self.host, gathered, strict=True):
                h[slots] = np.asarray(a)[: len(slots)]
        self._pending = []


def _chunks(pairs: list[tuple[int, int]]):
    """`pairs` in runs of at most the largest chunk size."""
    step = CHUNKS[-1]
    return [pairs[i : i + step] for i in range(0, len(pairs), step)]


def _padded(values, fill: int) -> np.ndarray:
    """`values` as i32, padded with `fill` to the smallest chunk size that holds them."""
    n = next(c for c in CHUNKS if c >= len(values))
    out = np.full(n, fill, np.int32)
    out[: len(values)] = values
    return out

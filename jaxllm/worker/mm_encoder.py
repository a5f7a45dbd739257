"""The vision encoder of an image-text model, beside the runner: the encoder programs, and
the encoder cache on the device that the forward pass reads image embeddings from.

The cache is one array of rows in the decoder's width, `num_blocks` blocks of the model's
`block_tokens` rows. The scheduler decides which image has which blocks
(`jaxllm.engine.encoder_cache`); a step's `encoder_inputs` are encoded first, each token's row
written to its place in the image's blocks (the array donated: updated in place), then the
forward pass takes each placeholder token's row of the cache instead of its embedding
(`StepExtras.mm_rows`). Padding writes past the last row: dropped.

Images are encoded whole, in launches padded to a bucket compiled at warmup, as the model's
vision config lays them out (`encoder_buckets`, `launch_size`, `pack`): for a model whose
images are all one size, a power of two of images up to the most one step encodes; for
Qwen2.5-VL (images of any size), a power of two of patches in window order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.models.qwen_vision import QwenVisionConfig, QwenVisionEncoder
from jaxllm.models.vision import VisionConfig, VisionEncoder
from jaxllm.worker.compiler import Compiler
from jaxllm.worker.device_state import DeviceState
from jaxllm.worker.features import Feature, Warmup
from jaxllm.worker.step_data import EncoderInput, SchedulerOutput


def encoder_cache_bytes(config: VisionConfig | QwenVisionConfig, num_blocks: int, dtype) -> int:
    """The encoder cache's bytes on each device (it is replicated)."""
    rows = num_blocks * config.block_tokens
    return rows * config.text_hidden_size * jnp.dtype(dtype).itemsize


def encode(graphdef, params_def, params, pool: jax.Array, rows: jax.Array, *inputs: jax.Array):
    """The encoder cache with the embeddings of the encoder's `inputs` written to `rows` (one
    per embedding; past the cache: dropped)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(params_def, params))
    embeds = model(*inputs)
    embeds = embeds.reshape(-1, embeds.shape[-1]).astype(pool.dtype)
    return pool.at[rows].set(embeds, mode="drop")


def store(pool: jax.Array, rows: jax.Array, embeds: jax.Array):
    """The encoder cache with image embeddings given by a prompt (`enable_mm_embeds`) written
    to `rows` (past the cache: dropped)."""
    return pool.at[rows].set(embeds.astype(pool.dtype), mode="drop")


class MMEncoder(Feature):
    def __init__(
        self,
        encoder: VisionEncoder | QwenVisionEncoder,
        device: DeviceState,
        compiler: Compiler,
        *,
        num_blocks: int,
        budget: int,
        dtype,
        embeds: bool = False,
    ):
        """`num_blocks`: the encoder cache's blocks; `budget`: the image tokens a step
        encodes at most; `dtype`: the decoder's embeddings'; `embeds`: prompts may carry image
        embeddings, written as they are (`store`, in buckets of rows: powers of two from 16
        up to the budget)."""
        self.config = c = encoder.config
        self.device, self.compiler = device, compiler
        self.num_rows = num_blocks * c.block_tokens
        self.graphdef, state = nnx.split(encoder)
        self.params, params_def = jax.tree.flatten(state)
        self._pool_spec = (self.num_rows, c.text_hidden_size), dtype
        if device.abstract:  # `jaxllm compile`: shapes only
            self.pool = jax.ShapeDtypeStruct(*self._pool_spec, sharding=device.replicated)
        else:
            self.pool = self._zeros_pool()
        self._sleep = None  # asleep: (the weights' shardings, their host copies or None)
        self.buckets = c.encoder_buckets(num_blocks, budget)
        top = max(4, (budget - 1).bit_length())
        self.store_buckets = [1 << i for i in range(4, top + 1)] if embeds else []
        # The cache stays replicated (the forward passes were compiled for it), whatever the
        # projector's sharding would make of the rows written into it.
        self._encode = jax.jit(
            functools.partial(encode, self.graphdef, params_def),
            donate_argnums=(1,),
            out_shardings=None if device.mesh is None else device.replicated,
        )
        self._store = jax.jit(
            store,
            donate_argnums=(0,),
            out_shardings=None if device.mesh is None else device.replicated,
        )

    @property
    def num_programs(self) -> int:
        return len(self.buckets) + len(self.store_buckets)

    def _zeros_pool(self) -> jax.Array:
        """An empty encoder cache, placed as warmup saw it (see `encoder_cache_bytes`)."""
        return self.device.put_if_mesh(jnp.zeros(*self._pool_spec))

    def sleep(self, *, keep_weights: bool) -> None:
        """Frees the device memory of the encoder's weights (to host memory with
        `keep_weights`) and of the encoder cache (its images are gone: the scheduler forgets
        them), as the runner's sleep mode does for the decoder."""
        if self._sleep is not None:
            return
        shardings = [p.sharding if p.committed else None for p in self.params]
        host = [np.array(p) for p in self.params] if keep_weights else None
        for p in [*self.params, self.pool]:
            p.delete()
        self.params, self.pool = [], None
        self._sleep = (shardings, host)

    def wake_up(self, weights: list | None = None) -> None:
        """The weights back where they were (from host memory, or `weights`: the encoder's
        flat parameter list, freshly loaded, after a level-2 sleep), and an empty cache."""
        if self._sleep is None:
            return
        shardings, host = self._sleep
        source = host if host is not None else weights
        if source is None or len(source) != len(shardings):
            raise ValueError("wake_up: the vision encoder's weights were dropped; give them")
        self.params = [jax.device_put(w, s) for w, s in zip(source, shardings, strict=True)]
        self.pool = self._zeros_pool()
        self._sleep = None

    def _rows(self, item: EncoderInput) -> np.ndarray:
        """The cache rows of an image's tokens, in order."""
        bt = self.config.block_tokens
        rows = np.asarray(item.blocks, np.int32)[:, None] * bt + np.arange(bt, dtype=np.int32)
        return rows.reshape(-1)

    def _launches(self, inputs: list[EncoderInput], size_of, buckets: list[int], bucket):
        """Each launch's (images as (array, their tokens' cache rows) pairs, bucket) for
        `inputs`: as many images a launch as the largest of `buckets` holds (`size_of` an
        array's shape: its share), padded to the smallest that holds them (`bucket`: that
        one, for warmup's empty launch)."""
        groups: list[list] = [[]]
        sizes = [0]
        for item in inputs:
            array = item.values.array()
            n = size_of(array.shape)
            if sizes[-1] + n > buckets[-1]:
                groups.append([])
                sizes.append(0)
            groups[-1].append((array, self._rows(item)))
            sizes[-1] += n
        return [
            (group, bucket or next(b for b in buckets if b >= n))
            for group, n in zip(groups, sizes, strict=True)
        ]

    def _batches(self, inputs: list[EncoderInput], bucket: int | None = None) -> list[tuple]:
        """The encoder's arguments (rows, *inputs) of each launch that encodes `inputs`."""
        c = self.config
        launches = self._launches(inputs, c.launch_size, self.buckets, bucket)
        return [c.pack(group, b, self.num_rows) for group, b in launches]

    def _stores(self, inputs: list[EncoderInput], bucket: int | None = None) -> list[tuple]:
        """`store`'s (rows, embeds) of each launch that writes `inputs`' embeddings."""
        width = self.config.text_hidden_size
        out = []
        for group, b in self._launches(
            inputs, lambda shape: int(np.prod(shape)) // width, self.store_buckets, bucket
        ):
            rows = np.full(b, self.num_rows, np.int32)
            embeds = np.zeros((b, width), np.float32)
            at = 0
            for array, image_rows in group:
                array = array.reshape(-1, width)
                rows[at : at + len(array)] = image_rows[: len(array)]
                embeds[at : at + len(array)] = array
                at += len(array)
            out.append((rows, embeds))
        return out

    def launch(self, inputs: list[EncoderInput]) -> None:
        """Encodes a step's images into their rows, and writes the embeddings prompts gave
        (dispatched, not waited for)."""
        put = self.device.put_if_mesh
        images = [i for i in inputs if not i.embeds]
        if images:
            for args in self._batches(images):
                self.pool = self._encode(self.params, self.pool, *map(put, args))
        given = [i for i in inputs if i.embeds]
        if given:
            for args in self._stores(given):
                self.pool = self._store(self.pool, *map(put, args))

    def before_forward(self, out: SchedulerOutput) -> None:
        """Encodes the step's images before the forward pass reads their rows."""
        if out.encoder_inputs:
            self.launch(out.encoder_inputs)

    def warmup_jobs(self, warm: Warmup) -> list:
        def job(b: int):
            (args,) = self._batches([], bucket=b)
            args = (self.params, self.pool, *map(self.device.abstract_input, args))
            self.compiler.compile("encode_images", (b,), self._encode, *args)

        def store_job(b: int):
            (args,) = self._stores([], bucket=b)
            args = (self.pool, *map(self.device.abstract_input, args))
            self.compiler.compile("store_image_embeds", (b,), self._store, *args)

        return [functools.partial(job, b) for b in self.buckets] + [
            functools.partial(store_job, b) for b in self.store_buckets
        ]

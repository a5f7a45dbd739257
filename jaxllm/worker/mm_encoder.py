"""The vision encoder of an image-text model, beside the runner: the encoder programs, and
the encoder cache on the device that the forward pass reads image embeddings from.

The cache is one array of rows in the decoder's width, `num_slots` slots of
`tokens_per_image` rows each and one more slot where padding images write. The scheduler
decides which image has which slot (`jaxllm.engine.encoder_cache`); a step's `encoder_inputs`
are encoded first, each into its slot (the array donated: updated in place), then the forward
pass takes each placeholder token's row of the cache instead of its embedding
(`BatchInputs.mm_rows`). Images are encoded whole, in batches padded to a bucket of images per
step: a power of two up to the most one step can encode, all compiled at warmup.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.models.vision import VisionConfig, VisionEncoder
from jaxllm.worker.compiler import Compiler
from jaxllm.worker.device_state import DeviceState
from jaxllm.worker.step_data import EncoderInput


def encoder_cache_bytes(config: VisionConfig, num_slots: int, dtype) -> int:
    """The encoder cache's bytes on each device (it is replicated): its slots and the spare."""
    rows = (num_slots + 1) * config.tokens_per_image
    return rows * config.text_hidden_size * jnp.dtype(dtype).itemsize


def encode(graphdef, params_def, params, pool: jax.Array, pixels: jax.Array, slots: jax.Array):
    """The encoder cache with images `pixels` [B, C, H, W] written to their `slots` [B]."""
    model = nnx.merge(graphdef, jax.tree.unflatten(params_def, params))
    embeds = model(pixels)  # [B, P, D]
    b, p, d = embeds.shape
    rows = (slots[:, None] * p + jnp.arange(p, dtype=slots.dtype)).reshape(-1)
    return pool.at[rows].set(embeds.reshape(b * p, d).astype(pool.dtype), mode="drop")


class MMEncoder:
    def __init__(
        self,
        encoder: VisionEncoder,
        device: DeviceState,
        compiler: Compiler,
        *,
        num_slots: int,
        max_items_per_step: int,
        dtype,
    ):
        """`num_slots`: images the encoder cache holds; `max_items_per_step`: the most a step
        encodes (the largest bucket); `dtype`: the decoder's embeddings'."""
        self.config: VisionConfig = encoder.config
        self.device, self.compiler = device, compiler
        self.num_slots = num_slots
        self.graphdef, state = nnx.split(encoder)
        self.params, params_def = jax.tree.flatten(state)
        p = self.config.tokens_per_image
        self._pool_spec = ((num_slots + 1) * p, self.config.text_hidden_size), dtype
        if device.abstract:  # `jaxllm compile`: shapes only
            self.pool = jax.ShapeDtypeStruct(*self._pool_spec, sharding=device.replicated)
        else:
            self.pool = self._zeros_pool()
        self._sleep = None  # asleep: (the weights' shardings, their host copies or None)
        self.buckets = [1 << i for i in range(max(1, max_items_per_step).bit_length())]
        if self.buckets[-1] < max_items_per_step:
            self.buckets.append(max_items_per_step)
        # The cache stays replicated (the forward passes were compiled for it), whatever the
        # projector's sharding would make of the rows written into it.
        self._encode = jax.jit(
            functools.partial(encode, self.graphdef, params_def),
            donate_argnums=(1,),
            out_shardings=None if device.mesh is None else device.replicated,
        )

    @property
    def num_programs(self) -> int:
        return len(self.buckets)

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

    def _padded(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Pixels and slots of a batch of `n` padding images (they write to the spare slot)."""
        b = next(b for b in self.buckets if b >= n)
        return np.zeros((b, *self.config.pixel_shape), np.float32), np.full(
            b, self.num_slots, np.int32
        )

    def launch(self, inputs: list[EncoderInput]) -> None:
        """Encodes a step's images into their slots (dispatched, not waited for)."""
        most = self.buckets[-1]
        for start in range(0, len(inputs), most):
            batch = inputs[start : start + most]
            pixels, slots = self._padded(len(batch))
            for i, item in enumerate(batch):
                pixels[i] = item.pixels.array()
                slots[i] = item.slot
            put = self.device.put_if_mesh
            self.pool = self._encode(self.params, self.pool, put(pixels), put(slots))

    def warmup_jobs(self) -> list:
        def job(b: int):
            pixels, slots = self._padded(b)
            args = (self.params, self.pool, *map(self.device.abstract_input, (pixels, slots)))
            self.compiler.compile("encode_images", (b,), self._encode, *args)

        return [functools.partial(job, b) for b in self.buckets]

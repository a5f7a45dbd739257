"""What a runner keeps on its devices between steps, besides the parameters: the model's cache
(`ModelCache`: the paged KV cache today) and the token each batch row sampled last; where host inputs go; and how both are
remade when a failed step took its donated buffers with it.

A runner over abstract parameters (`jax.ShapeDtypeStruct`s placed on the devices of a target
that may not be here, see `jaxllm.aot`) keeps abstract arrays here: it compiles every program
and runs none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import pallas_kernels
from jaxllm import sharding
from jaxllm.models import ModelCache
from jaxllm.models.linear_attention import LinearState
from pallas_kernels import KVCache, is_quantized_dtype, zeros_kv_cache
from pallas_kernels.kv_cache import abstract_kv_cache


class DeviceState:
    def __init__(
        self,
        first_param: jax.Array | jax.ShapeDtypeStruct,
        mesh: Mesh | None,
        cache_shape: tuple[int, ...],
        cache_dtype: jnp.dtype,
        max_num_seqs: int,
        linear: LinearState | None = None,
    ):
        """`first_param`: one of the model's parameters (abstract ones make an abstract state,
        on their devices); `mesh`: the tensor-parallel mesh the model was loaded onto (the KV
        cache is split over its kv heads the same way), None for one device. `linear`: a hybrid
        model's recurrent state (its arrays' `jax.ShapeDtypeStruct`s), split over the mesh as
        `LinearState.specs` says."""
        self.mesh = mesh
        self.abstract = isinstance(first_param, jax.ShapeDtypeStruct)
        # Where host inputs go: the default device (the target's, for an abstract state), or
        # replicated over the mesh.
        self.replicated = None if mesh is None else sharding.replicated(mesh)
        if self.abstract and mesh is None:
            self.replicated = first_param.sharding
        self.max_num_seqs = max_num_seqs
        self._zeros_programs: dict = {}
        self.cache = self.zeros_model_cache(cache_shape, cache_dtype, linear)
        self.kv_cache_lost = False  # set when a failed step took a cache with it
        # The token each batch row sampled last, kept on the device: the next step's decode
        # input for that row when it was scheduled before this step's output came back.
        self.last_tokens = self.zeros_last_tokens()

    @property
    def device(self) -> jax.Device:
        """One of the devices the programs run on (a compile-only target's, when abstract)."""
        if self.replicated is None:
            return jax.devices()[0]
        return next(iter(self.replicated.device_set))

    @property
    def platform(self) -> str:
        return self.device.platform

    @property
    def kv_cache(self) -> KVCache:
        """The paged KV cache (the model cache's `kv`)."""
        return self.cache.kv

    @kv_cache.setter
    def kv_cache(self, value: KVCache) -> None:
        self.cache = dataclasses.replace(self.cache, kv=value)

    @property
    def kv_cache_device_bytes(self) -> int:
        """The model cache's logical bytes on one device (all of it without a mesh)."""
        return self.cache.nbytes // (1 if self.mesh is None else self.mesh.shape["model"])

    def traced_for_target(self) -> contextlib.AbstractContextManager:
        """For an abstract state, kernels traced for its devices' platform (see
        `pallas_kernels.target_platform`); nothing to change otherwise."""
        if not self.abstract:
            return contextlib.nullcontext()
        device = self.device
        return pallas_kernels.target_platform(device.platform, device)

    def abstract_input(self, x):
        """A host input of an abstract runner's program, as an abstract value on its devices."""
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        x = np.asarray(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated)

    def put(self, host):
        """Host arrays (a pytree) placed where host inputs go (abstract values when abstract)."""
        if self.abstract:
            return jax.tree.map(self.abstract_input, host)
        return jax.device_put(host, self.replicated)

    def put_if_mesh(self, host):
        """Host arrays that a program takes as they are on one device, placed on a mesh as the
        device-resident inputs warmup saw were."""
        return host if self.mesh is None else jax.device_put(host, self.replicated)

    def zeros_last_tokens(self) -> jax.Array:
        return self.put(np.zeros(self.max_num_seqs, np.int32))

    def zeros_cache(self, shape, dtype) -> KVCache:
        """A zero cache, created in place on its devices (split on kv heads under a mesh); an
        abstract state's is abstract."""
        if self.mesh is None:
            if self.abstract:
                return abstract_kv_cache(shape, dtype, (self.replicated,) * 2)
            return zeros_kv_cache(shape, dtype, self.platform)
        out = sharding.kv_cache_sharding(self.mesh, is_quantized_dtype(dtype))
        if self.abstract:
            return abstract_kv_cache(shape, dtype, out)
        shards = self.mesh.shape["model"]
        return self._made_on_devices(
            ("kv", tuple(shape), jnp.dtype(dtype)),
            lambda: zeros_kv_cache(shape, dtype, self.platform, shards),
            out,
        )

    def _made_on_devices(self, key, make, out):
        """`make()` run as a program whose result is placed as `out` says (made where it
        lives, never whole on one device); one program per `key`, kept: remaking a cache
        compiles nothing."""
        program = self._zeros_programs.get(key)
        if program is None:
            program = self._zeros_programs[key] = jax.jit(make, out_shardings=out)
        return program()

    def zeros_model_cache(self, kv_shape, kv_dtype, linear: LinearState | None = None):
        """A zero model cache of a KV cache of `kv_shape` and `kv_dtype` (see `zeros_cache`)
        and, for a hybrid model, a zero recurrent state of `linear`'s shapes. The one place a
        model cache is made: a new kind of state is made here too."""
        if linear is not None:
            linear = jax.tree.map(self._zeros, linear, LinearState.specs())
        return ModelCache(kv=self.zeros_cache(kv_shape, kv_dtype), linear=linear)

    def _zeros(self, shape: jax.ShapeDtypeStruct, spec) -> jax.Array | jax.ShapeDtypeStruct:
        """A zero array made on its devices: split as `spec` says under a mesh."""
        where = self.replicated
        if self.mesh is not None:
            where = jax.sharding.NamedSharding(self.mesh, spec)
        if self.abstract:
            return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=where)
        if where is None:
            return jnp.zeros(shape.shape, shape.dtype)
        zeros = functools.partial(jnp.zeros, shape.shape, shape.dtype)
        return self._made_on_devices((shape.shape, jnp.dtype(shape.dtype), where), zeros, where)

    def _spec(self, cache: ModelCache) -> tuple:
        """What `zeros_model_cache` needs to make `cache` anew."""
        linear = None
        if cache.linear is not None:
            linear = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), cache.linear)
        return cache.kv.shape, cache.kv.dtype, linear

    def renewed(self, cache: ModelCache) -> ModelCache:
        """`cache`, or a zero one in its place when a failed step deleted one of its arrays."""
        if not any(a.is_deleted() for a in cache.arrays()):
            return cache
        self.kv_cache_lost = True
        return self.zeros_model_cache(*self._spec(cache))

    def drop_cache(self) -> tuple:
        """Frees the model cache's device memory (sleep); returns what `restore_cache`
        needs."""
        spec = self._spec(self.cache)
        for a in self.cache.arrays():
            a.delete()
        return spec

    def restore_cache(self, spec: tuple) -> None:
        """A zero model cache again, as `drop_cache` left it (wake up)."""
        self.cache = self.zeros_model_cache(*spec)

    @contextlib.contextmanager
    def recovering(self, others: Iterable = ()):
        """A failed step may take the buffers it was donated with it: start from fresh ones so
        the engine can serve again (the caller drops every cached prefix). `others`: holders of
        another model cache (a draft model's), as their `cache` attribute."""
        try:
            yield
        except BaseException:
            self.cache = self.renewed(self.cache)
            for holder in others:
                holder.cache = self.renewed(holder.cache)
            if self.last_tokens.is_deleted():
                self.last_tokens = self.zeros_last_tokens()
            raise

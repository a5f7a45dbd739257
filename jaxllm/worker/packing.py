"""A step's host inputs sent to the device in one transfer: a pytree of 32-bit (and boolean)
arrays laid out in one int32 buffer, filled on the host through views of it, and unpacked in
the program by static slices.

Sent leaf by leaf, a step's ~30 small inputs were as many host-to-device copies: on the CPU
about 1 ms of a 64-row step's dispatch (measured on a 2-core machine; one buffer of the same
bytes took 0.1 ms), and on a GPU as many DMA launches before the step could start. A `Layout`
is fixed per compiled shape, so the program of that shape knows where each input lies.

    layout = Layout.of(template)            # once per shape: offsets, shapes, dtypes
    buffer, tree = layout.new(template)     # per step: a copy of the template and its views
    tree.input_ids[:n] = ...                # filled in place, as plain numpy arrays
    program(layout, buffer)                 # in the program: tree = layout.unpack(buffer)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_WORD = np.dtype(np.int32)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of a pytree lies in one int32 buffer: static (hashable), a program's
    key together with its shape."""

    treedef: Any  # jax.tree_util.PyTreeDef
    # (offset in words, words, shape, dtype) per leaf
    leaves: tuple[tuple[int, int, tuple[int, ...], str], ...]
    size: int  # words

    @classmethod
    def of(cls, tree) -> Layout:
        """The layout of `tree`'s leaves (numpy arrays or shape-dtype structs of 32-bit types
        or bool), one after the other."""
        flat, treedef = jax.tree.flatten(tree)
        leaves, offset = [], 0
        for leaf in flat:
            dtype = np.dtype(leaf.dtype)
            if dtype.itemsize != 4 and dtype != np.bool_:
                raise ValueError(f"packing holds 32-bit and bool arrays, not {dtype}")
            shape = tuple(int(d) for d in leaf.shape)
            words = math.prod(shape)
            leaves.append((offset, words, shape, dtype.name))
            offset += words
        return cls(treedef, tuple(leaves), offset)

    def pack(self, tree) -> np.ndarray:
        """A new buffer holding `tree` (laid out as this layout says)."""
        buffer = np.empty(self.size, np.int32)
        for view, leaf in zip(self._views(buffer), jax.tree.leaves(tree), strict=True):
            view[...] = leaf
        return buffer

    def views(self, buffer: np.ndarray):
        """The pytree over `buffer`: each leaf a view of its words (a boolean leaf as int32:
        nonzero is true), writable in place."""
        return jax.tree.unflatten(self.treedef, self._views(buffer))

    def _views(self, buffer: np.ndarray) -> list[np.ndarray]:
        out = []
        for offset, words, shape, dtype in self.leaves:
            view = buffer[offset : offset + words]
            if dtype not in ("int32", "bool"):
                view = view.view(dtype)
            out.append(view.reshape(shape))
        return out

    def unpack(self, buffer: jax.Array):
        """The pytree, in a program, from the buffer this layout packed (i32[size])."""
        leaves = []
        for offset, size, shape, dtype in self.leaves:
            words = buffer[offset : offset + size]
            if dtype == "bool":
                leaf = words != 0
            elif dtype == "int32":
                leaf = words
            else:
                leaf = jax.lax.bitcast_convert_type(words, jnp.dtype(dtype))
            leaves.append(leaf.reshape(shape))
        return jax.tree.unflatten(self.treedef, leaves)

    def abstract(self, sharding=None) -> jax.ShapeDtypeStruct:
        """The buffer as an abstract value (for compiling)."""
        return jax.ShapeDtypeStruct((self.size,), jnp.int32, sharding=sharding)


# Buffers a template hands out in turn: a step's are read by the device_put that sends them,
# inside the call, and the next step is prepared while one step is in flight (async
# scheduling); the third is a margin.
_RING = 3


@dataclasses.dataclass
class Template:
    """A layout with its buffer of neutral values (a step's padding): `new` hands out one of
    a few buffers, reset to those values, with its pytree of views (made once: the views'
    objects cost more than the copy)."""

    layout: Layout
    buffer: np.ndarray
    _ring: list = dataclasses.field(default_factory=list, repr=False)
    _turn: int = 0

    @classmethod
    def of(cls, tree) -> Template:
        layout = Layout.of(tree)
        return cls(layout, layout.pack(tree))

    def new(self):
        """(a buffer of the neutral values, its pytree of views): one of `_RING` in turn,
        written over by the call `_RING` calls later."""
        if len(self._ring) < _RING:
            buffer = self.buffer.copy()
            self._ring.append((buffer, self.layout.views(buffer)))
        else:
            np.copyto(self._ring[self._turn][0], self.buffer)
        buffer, tree = self._ring[self._turn]
        self._turn = (self._turn + 1) % _RING
        return buffer, tree

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
    leaves: tuple[tuple[int, tuple[int, ...], str], ...]  # (offset in words, shape, dtype)
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
            shape = tuple(leaf.shape)
            leaves.append((offset, shape, dtype.name))
            offset += int(np.prod(shape, dtype=np.int64))
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
        for offset, shape, dtype in self.leaves:
            words = buffer[offset : offset + int(np.prod(shape, dtype=np.int64))]
            view = words if dtype in ("int32", "bool") else words.view(dtype)
            out.append(view.reshape(shape))
        return out

    def unpack(self, buffer: jax.Array):
        """The pytree, in a program, from the buffer this layout packed (i32[size])."""
        leaves = []
        for offset, shape, dtype in self.leaves:
            words = buffer[offset : offset + int(np.prod(shape, dtype=np.int64))]
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


@dataclasses.dataclass(frozen=True)
class Template:
    """A layout with its buffer of neutral values (a step's padding): `new` copies it."""

    layout: Layout
    buffer: np.ndarray

    @classmethod
    def of(cls, tree) -> Template:
        layout = Layout.of(tree)
        return cls(layout, layout.pack(tree))

    def new(self):
        """(a fresh buffer of the neutral values, its pytree of views)."""
        buffer = self.buffer.copy()
        return buffer, self.layout.views(buffer)

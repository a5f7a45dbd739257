"""How a layer's heads sit in the paged KV cache when its layers differ in head width or kv
heads (Gemma 4: sliding layers with 16 kv heads of 256, full-attention layers with 4 of 512).

The cache has one row shape for every layer, `[cache_kv_heads, page_size, 2 * W]` per slot
and page, W the widest layer's head (`ModelConfig.cache_head_dim`). A layer whose heads are
narrower packs `pack = W / H` of them into one row: row r holds kv heads r*pack ... r*pack +
pack - 1 side by side, keys then values (`[k_a k_b | v_a v_b]`). Attention needs no kernel of
its own for that: a query of kv head j is placed in its head's lanes of a W-wide query, zeros
elsewhere, so its scores see only its own head's keys; its output is its head's lanes of the
row's values. Every packed row's queries are contiguous (GQA numbers query heads by kv head),
so the kernels see a plain GQA layout of `packed` kv heads and pack x group queries each. The
cost is compute on the zero lanes (a sliding layer's scores at twice the width), never memory:
the cache holds exactly the layer's keys and values (padded only when its kv heads do not fill
whole rows).

A layer with more packed heads than a slot holds spreads them over `parts` slots
(`ModelConfig.layer_kv_parts`) and attends once per part: attention heads are independent.
A model whose layers all have one head width and kv head count is unchanged by all this:
pack 1, one part.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """One layer's place in the cache (static)."""

    num_kv_heads: int
    """K: the layer's own kv heads."""
    head_dim: int
    """H: the layer's head width."""
    group: int
    """Query heads per kv head."""
    pack: int
    """Kv heads per cache row (W / H)."""
    parts: int
    """Cache slots the layer's rows fill."""

    @classmethod
    def of(cls, config: ModelConfig, layer: int) -> KVLayout:
        return cls(
            num_kv_heads=config.layer_num_kv_heads(layer),
            head_dim=config.layer_head_dim(layer),
            group=config.layer_num_heads_per_kv(layer),
            pack=config.layer_kv_pack(layer),
            parts=config.layer_kv_parts(layer),
        )

    @property
    def plain(self) -> bool:
        """The layer's heads are the cache's, as they are."""
        return self.pack == 1 and self.parts == 1

    @property
    def padded_kv_heads(self) -> int:
        """K rounded up to whole rows."""
        return -(-self.num_kv_heads // self.pack) * self.pack

    def pack_kv(self, x: jax.Array) -> list[jax.Array]:
        """[T, K, H] keys or values -> per part [T, rows, W]."""
        x = self._pad_heads(x, 1)
        rows = x.reshape(x.shape[0], -1, self.pack * self.head_dim)
        return jnp.split(rows, self.parts, axis=1)

    def pack_q(self, q: jax.Array) -> list[jax.Array]:
        """[T, K * group, H] queries -> per part [T, rows * pack * group, W], each query in its
        kv head's lanes of its row."""
        t, h, p = q.shape[0], self.head_dim, self.pack
        q = self._pad_heads(q.reshape(t, self.num_kv_heads, self.group, h), 1)
        q = q.reshape(t, -1, p, self.group, 1, h)  # [T, rows, pack, group, 1, H]
        lanes = jnp.eye(p, dtype=q.dtype).reshape(1, 1, p, 1, p, 1)
        wide = (q * lanes).reshape(t, -1, p * self.group, p * h)  # [T, rows, pack*group, W]
        return [part.reshape(t, -1, p * h) for part in jnp.split(wide, self.parts, axis=1)]

    def pack_heads(self, x: jax.Array) -> list[jax.Array]:
        """A value per query head [K * group] (gpt-oss's sinks) -> per part, in `pack_q`'s
        order (padding heads: zero)."""
        x = self._pad_heads(x.reshape(self.num_kv_heads, self.group), 0)
        rows = x.reshape(-1, self.pack * self.group)
        return [part.reshape(-1) for part in jnp.split(rows, self.parts)]

    def unpack_out(self, parts: list[jax.Array]) -> jax.Array:
        """Per part [T, rows * pack * group, W] attention outputs -> [T, K * group, H]."""
        out = jnp.concatenate(parts, axis=1)
        t, h, p = out.shape[0], self.head_dim, self.pack
        out = out.reshape(t, -1, p, self.group, p, h)
        lanes = jnp.eye(p, dtype=out.dtype).reshape(1, 1, p, 1, p, 1)
        out = (out * lanes).sum(axis=4)  # each query's own head's lanes
        out = out.reshape(t, -1, self.group, h)[:, : self.num_kv_heads]
        return out.reshape(t, self.num_kv_heads * self.group, h)

    def _pad_heads(self, x: jax.Array, axis: int) -> jax.Array:
        extra = self.padded_kv_heads - self.num_kv_heads
        if not extra:
            return x
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, extra)
        return jnp.pad(x, pad)

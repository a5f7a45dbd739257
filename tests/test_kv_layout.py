"""Layers packed into the cache's rows (`jaxllm.models.kv_layout`): narrower heads side by side
in one row, a layer over several slots, kv heads padded to whole rows. Attention through the
packed layout equals attention over the layer's own heads, sinks included."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models.kv_layout import KVLayout
from pallas_kernels import get_kv_cache_shape, ragged_paged_attention, write_kv


def _attend(q, k, v, layout: KVLayout | None, sinks, *, width: int, rows_per_slot: int):
    """Writes k and v into a fresh cache (packed by `layout`, or as they are) and attends."""
    num_tokens, page = q.shape[0], 8
    pages = -(-num_tokens // page)
    args = (
        jnp.array([num_tokens], jnp.int32),
        jnp.arange(pages, dtype=jnp.int32)[None],
        jnp.array([0, num_tokens], jnp.int32),
        jnp.array([1], jnp.int32),
    )
    slots = jnp.arange(num_tokens, dtype=jnp.int32)
    kw = dict(sm_scale=0.3, sliding_window=5, backend="reference")
    if layout is None:
        cache = jnp.zeros(get_kv_cache_shape(1, pages, page, k.shape[1], k.shape[2]))
        cache = write_kv(cache, 0, k, v, slots)
        return ragged_paged_attention(q, cache, 0, *args, sinks=sinks, **kw)
    cache = jnp.zeros(get_kv_cache_shape(layout.parts, pages, page, rows_per_slot, width))
    qs, ks, vs = layout.pack_q(q), layout.pack_kv(k), layout.pack_kv(v)
    sink_parts = [None] * layout.parts if sinks is None else layout.pack_heads(sinks)
    outs = []
    for part in range(layout.parts):
        cache = write_kv(cache, part, ks[part], vs[part], slots)
        outs.append(
            ragged_paged_attention(qs[part], cache, part, *args, sinks=sink_parts[part], **kw)
        )
    return layout.unpack_out(outs)


@pytest.mark.parametrize(
    "num_kv_heads,group,pack,parts",
    [(4, 2, 2, 2), (3, 2, 2, 2), (1, 4, 2, 1), (2, 1, 1, 2), (4, 3, 4, 1)],
)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_packed_attention_equals_the_layers_own(num_kv_heads, group, pack, parts, with_sinks):
    head_dim, num_tokens = 8, 19
    layout = KVLayout(num_kv_heads, head_dim, group, pack, parts)
    rows = -(-num_kv_heads // pack)
    assert rows % parts == 0
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)), jnp.float32)
    k, v = (
        jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), jnp.float32)
        for _ in range(2)
    )
    sinks = jnp.asarray(rng.standard_normal(num_kv_heads * group), jnp.float32)
    sinks = sinks if with_sinks else None
    expected = _attend(q, k, v, None, sinks, width=head_dim, rows_per_slot=0)
    got = _attend(q, k, v, layout, sinks, width=pack * head_dim, rows_per_slot=rows // parts)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=1e-5)

"""Running a loaded model directly (no engine) for logit comparisons."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxllm.models import AttentionMetadata
from pallas_kernels import get_kv_cache_shape


def prefill_logits(model, config, token_ids: list[int], page_size: int = 16) -> np.ndarray:
    """Logits f32[T, V] for every position of one sequence, through the paged-cache path."""
    num_tokens = len(token_ids)
    pages = -(-num_tokens // page_size)
    shape = get_kv_cache_shape(
        config.num_layers, pages, page_size, config.num_kv_heads, config.head_dim
    )
    cache = jnp.zeros(shape, jnp.float32)
    meta = AttentionMetadata(
        slot_mapping=jnp.arange(num_tokens, dtype=jnp.int32),
        seq_lens=jnp.array([num_tokens], jnp.int32),
        block_tables=jnp.arange(pages, dtype=jnp.int32)[None],
        cu_q_lens=jnp.array([0, num_tokens], jnp.int32),
        num_seqs=jnp.array([1], jnp.int32),
    )
    ids = jnp.asarray(token_ids, jnp.int32)
    hidden, _ = model(ids, jnp.arange(num_tokens, dtype=jnp.int32), cache, meta)
    return np.asarray(model.compute_logits(hidden))

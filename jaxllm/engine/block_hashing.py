"""Prefix-cache block hashes, computed as vLLM computes them, so that an outside indexer (llm-d's
KV-cache manager, or anything that reads the KV events, `kv_events.py`) can recompute a
prompt's block hashes from its token ids and find our blocks.

A full block's hash is `hash_fn((parent, tuple(token_ids), extra_keys))`: the parent block's
hash (the first block's parent is `none_hash`), the block's token ids, and what else decides
its keys and values, or None (vLLM's `hash_block_tokens`). `hash_fn` is the algorithm
`--prefix-caching-hash-algo` names, with vLLM's names and encodings:
- "sha256" (vLLM's default): SHA-256 of the tuple pickled (highest protocol);
- "sha256_cbor": SHA-256 of the tuple in canonical CBOR, which any language can rebuild (an
  indexer outside Python needs this one).
`none_hash` is `hash_fn` of the seed: `PYTHONHASHSEED` where set, else "vllm-none-hash"
(vLLM's current rule; an engine and an indexer agree on both by default).

The extra keys of a block (vLLM's `generate_block_hash_extra_keys`), in this order: the LoRA
adapter's name, then each image whose placeholders overlap the block as (its content hash, its
first placeholder's offset from the block's start), then the cache salt (first block only).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2

HASH_ALGOS = ("sha256", "sha256_cbor")
_SEED = "vllm-none-hash"


def sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256": sha256, "sha256_cbor": sha256_cbor}


class BlockHasher:
    """Hashes full blocks with one algorithm (`HASH_ALGOS`)."""

    def __init__(self, algo: str = "sha256"):
        if algo not in _FUNCTIONS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, got {algo!r}")
        self.algo = algo
        self.hash_fn = _FUNCTIONS[algo]
        self.none_hash = self.hash_fn(os.environ.get("PYTHONHASHSEED", _SEED))

    def hash_block(
        self, parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None = None
    ) -> bytes:
        """The hash of a full block after `parent`'s (None: the first block)."""
        parent = parent or self.none_hash
        return self.hash_fn((parent, tuple(int(t) for t in token_ids), extra_keys))


def block_extra_keys(request, start: int, end: int) -> tuple | None:
    """What besides its tokens decides the keys and values of `request`'s block of positions
    [start, end), as vLLM keys it (module doc): None when nothing does."""
    keys: list[Any] = []
    if request.lora is not None:
        keys.append(request.lora.lora_name)
    for item in request.mm_items:
        if item.offset < end and item.offset + item.length > start:
            keys.append((item.hash, item.offset - start))
    salt = getattr(request, "cache_salt", None)
    if salt is not None and start == 0:
        keys.append(salt)
    return tuple(keys) if keys else None


def external_hash(block_hash: bytes) -> int:
    """A block hash as KV events carry it (vLLM's default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`):
    its last 8 bytes as an unsigned big-endian integer."""
    return int.from_bytes(block_hash[-8:], "big")

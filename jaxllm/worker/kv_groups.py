"""How the layers share the paged KV cache: groups of layers, one block table per group (vLLM
V1's hybrid KV cache manager).

A sliding-window layer needs only its window's last tokens: once a block is wholly before the
window of every query still to come, its memory can serve someone else. A model that mixes
sliding and full-attention layers (Gemma 2/3, Qwen2 with `max_window_layers`) frees them per
layer group: the layers are grouped by window, each group has its own block table over one
shared pool, and a sliding group's table drops (to a null entry) the blocks behind its window.

The groups are equally sized so that one page serves any of them: the cache is
`[num_slots, num_pages, ...]` and layer j of every group is slot j (a page of group g holds
`num_slots` layers' K/V for the tokens of that block of g). The group size is the smallest
number of layers of one window kind, and the last group of a kind is padded (its extra slots
unused). Gemma 3 270M (15 sliding, 3 full layers): 6 groups of 3, one full; a sequence of 32k
tokens holds 6,624 bytes per token in float32 against 36,864 with one group of every layer
(`benchmarks/kv_bytes.py`).

Llama 4's chunked layers (a query sees its own chunk of C positions) keep what a window of C
would: each query's chunk starts within it. Scout's 48 layers are 36 chunked (8,192 tokens)
and 12 full: a long context keeps a quarter of the layers' tokens beyond 8k.

A layer wider than another in keys and values (Gemma 4's sliding layers: 16 kv heads of 256
against the full layers' 4 of 512, packed two to a 512-wide row, `ModelConfig.layer_kv_parts`)
fills several slots, each with a part of its heads: a group's slots are (layer, part) units. A
layer that shares another's KV (Gemma 4's last `kv_shared_layers`) has none: it reads the
other's slots.

A model whose layers all share one window (all full, or all sliding like Mistral) has one group
of all its layers: slot j is layer j, and a sliding one frees its blocks behind the window too.
`hybrid=False` (`--disable-hybrid-kv-cache-manager`) makes a mixed model one full group: every
layer keeps every token, as before this module.
"""

from __future__ import annotations

import dataclasses

from jaxllm.config import CacheConfig, ModelConfig


@dataclasses.dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int | None, ...]
    """Per group: the sliding window its layers share, or None (full attention: it keeps every
    block)."""
    layers: tuple[tuple[int, ...], ...]
    """Per group: its layers, in order; the j-th is in cache slot j. A layer that fills several
    slots (`ModelConfig.layer_kv_parts`) is named once per part, its parts in order."""

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        """The cache's leading dimension: the largest group's layers."""
        return max(len(layers) for layers in self.layers)

    @property
    def layer_slots(self) -> tuple[tuple[tuple[int, int], ...], ...] | None:
        """Per model layer, (its group, its slot in the cache) for each of its parts; () for a
        layer without KV of its own (a hybrid's linear layers, a layer sharing another's).
        None when that is one group whose slot i is layer i."""
        where: dict[int, list[tuple[int, int]]] = {}
        for g, layers in enumerate(self.layers):
            for j, layer in enumerate(layers):
                where.setdefault(layer, []).append((g, j))
        if self.layers == (tuple(range(len(where))),):
            return None
        return tuple(tuple(where.get(i, ())) for i in range(max(where) + 1))

    @classmethod
    def single(cls, layers: int | tuple[int, ...], window: int | None = None) -> KVCacheGroups:
        """One group of these layers (or of the first `layers`), in order."""
        layers = tuple(range(layers)) if isinstance(layers, int) else tuple(layers)
        return cls((window,), (layers,))


def kv_cache_groups(config: ModelConfig, *, hybrid: bool = True) -> KVCacheGroups:
    """The groups `config`'s layers share the cache in (see the module doc): one per window
    kind of `group size` layers, full attention first; without `hybrid`, a model with more
    than one window kind is one full group."""
    # A hybrid's linear layers keep no KV, nor do layers that share another's; a layer wider
    # than others in KV fills several slots, named once per part.
    units = [i for i in config.kv_layers for _ in range(config.layer_kv_parts(i))]
    # A chunked layer (Llama 4) keeps what a window of its chunk would: its queries' chunks
    # start within it.
    windows = {i: config.layer_kv_reach(i) for i in config.kv_layers}
    kinds = sorted(set(windows.values()), key=lambda w: -1 if w is None else w)
    if len(kinds) == 1:
        return KVCacheGroups.single(tuple(units), kinds[0])
    if not hybrid:
        return KVCacheGroups.single(tuple(units))
    by_kind = {w: [i for i in units if windows[i] == w] for w in kinds}
    size = min(len(layers) for layers in by_kind.values())
    group_windows, group_layers = [], []
    for w in kinds:
        layers = by_kind[w]
        for start in range(0, len(layers), size):
            group_windows.append(w)
            group_layers.append(tuple(layers[start : start + size]))
    return KVCacheGroups(tuple(group_windows), tuple(group_layers))


def engine_kv_groups(config: ModelConfig, cache: CacheConfig, *, draft: bool) -> KVCacheGroups:
    """The groups an engine serves `config` with: `kv_cache_groups` unless turned off; one full
    group with a draft model, which shares the target's block tables for its own layers."""
    if draft:
        return KVCacheGroups.single(tuple(config.kv_layers))
    return kv_cache_groups(config, hybrid=not cache.disable_hybrid_kv_cache_manager)

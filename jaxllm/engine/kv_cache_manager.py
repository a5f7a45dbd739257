"""The pool of KV cache pages, each request's block table, and automatic prefix caching.

Pages ("blocks") hold `page_size` tokens of every layer. A request owns a block table that
grows as its tokens are scheduled and is released when it finishes, is aborted or is
preempted. Blocks carry reference counts because a block can be shared.

Prefix caching: once a block is full, its key is a SHA-256 chained from the parent block's key
and the block's token ids, so equal keys mean equal prefixes. A new request looks its blocks'
keys up in order and reuses the longest run of hits: those tokens start out computed. A
released block keeps its key and waits in an LRU free queue: a later hit revives it, and it is
evicted (its key dropped) only when a new block is needed and it is the least recently freed.
A request's blocks are released last-first, so the tail of a sequence, the part least likely
to be shared, is evicted before its head.

With a host tier (`HostBlockPool`, `--kv-offloading-size`), an evicted cached block is copied to
host memory under its key, and a lookup goes on past the device's hits into the host's: those
blocks get fresh device blocks, keyed at once, which the step copies back before it runs. The
copies each step needs are taken with `take_transfers` into the scheduler's output.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from jaxllm.engine.kv_offload import HostBlockPool
from jaxllm.engine.request import Request


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    """The key of a full block: SHA-256 over the parent's key and the block's token ids."""
    h = hashlib.sha256(parent or b"\x00" * 32)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def _chain_root(request: Request) -> bytes | None:
    """The parent of a request's first block: none, or its LoRA adapter (a prefix computed
    under one adapter holds other K/V than under another, or none)."""
    lora = request.lora
    if lora is None:
        return None
    return hashlib.sha256(
        f"lora\0{lora.lora_int_id}\0{lora.lora_name}\0{lora.lora_path}".encode()
    ).digest()


class KVCacheManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        enable_prefix_caching: bool = True,
        host: HostBlockPool | None = None,
    ):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.block_keys: list[bytes | None] = [None] * num_pages
        # Free blocks, least recently freed first; cached ones keep their key until evicted.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self.cached: dict[bytes, int] = {}  # key -> block holding that prefix
        self.block_tables: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # per request: leading blocks with keys
        self._hashes: dict[str, list[bytes]] = {}  # per request: keys of its full blocks
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found (on the device or in the host tier)
        self.host = host
        # This step's copies: (device block, host slot) stores, (host slot, device block) loads.
        self._stores: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        # Per request being admitted: (device hits, the keys found in the host tier after them).
        self._host_hits: dict[str, tuple[int, list[bytes]]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- prefix cache ----------------------------------------------------------------

    def _block_hashes(self, request: Request) -> list[bytes]:
        """Keys of the request's full blocks, extended as its tokens grow."""
        hashes = self._hashes.setdefault(request.request_id, [])
        tokens, size = request.all_token_ids, self.page_size
        while (len(hashes) + 1) * size <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else _chain_root(request)
            hashes.append(hash_block(parent, tokens[i * size : (i + 1) * size]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of the request: (block ids, number of tokens).

        At least one token is always left to compute: the step must produce logits."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.page_size
        hashes = self._block_hashes(request)[:max_blocks]
        blocks = []
        for key in hashes:
            block = self.cached.get(key)
            if block is None:
                break
            blocks.append(block)
        self._host_hits.pop(request.request_id, None)
        if self.host is None:
            return blocks, len(blocks) * self.page_size
        keys = []  # then the host tier's hits, which `allocate_slots` gives device blocks
        for key in hashes[len(blocks) :]:
            if key not in self.host or key in self.cached:
                break
            keys.append(key)
        if keys:
            self._host_hits[request.request_id] = (len(blocks), keys)
        return blocks, (len(blocks) + len(keys)) * self.page_size

    def record_lookup(self, num_queried: int, num_hits: int) -> None:
        """Counts one admitted request's lookup (tokens queried and found)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_queried
            self.prefix_cache_hits += num_hits

    def cache_full_blocks(self, request: Request) -> None:
        """Gives keys to the request's blocks that became full and computed."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self.block_tables.get(rid, [])
        start = self._num_cached_blocks.get(rid, 0)
        # Speculative decoding: a stop inside accepted drafts leaves confirmed tokens that
        # were never appended (the ones after the stop).
        confirmed = min(request.num_confirmed_tokens, request.num_tokens)
        end = min(confirmed // self.page_size, len(table))
        if end <= start:
            return
        hashes = self._block_hashes(request)
        for i in range(start, end):
            block, key = table[i], hashes[i]
            if key not in self.cached and self.block_keys[block] is None:
                self.cached[key] = block
                self.block_keys[block] = key
            # Else an equal block is cached already (computed concurrently): this one stays
            # a plain block and returns to the pool uncached.
        self._num_cached_blocks[rid] = end

    def reset_prefix_cache(self, *, host: bool = True) -> bool:
        """Forgets every cached prefix, in the host tier too unless `host` is off (sleep:
        the device's cache is dropped, the host's copies stay right). Only possible while no
        block is in use (as in vLLM)."""
        if self.num_free_blocks != self.num_pages:
            return False
        self.cached.clear()
        self.block_keys = [None] * self.num_pages
        if self.host is not None and host:
            self.host.clear()
        return True

    # ---- allocation ------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[int] | None = None,
        *,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Grows the request's block table to hold `num_computed_tokens + num_new_tokens`
        tokens and `num_lookahead_tokens` more (a draft model's drafts), starting with
        `computed_blocks` (prefix-cache hits) for a new request, then fresh blocks for the
        host tier's hits that `get_computed_blocks` found after them (loaded by this step).
        Returns False, changing nothing, when the pool has too few free blocks."""
        computed_blocks = computed_blocks or []
        rid = request.request_id
        host_keys = []
        if rid not in self.block_tables and rid in self._host_hits:
            num_device, keys = self._host_hits[rid]
            host_keys = keys if num_device == len(computed_blocks) else []
        table = self.block_tables.get(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        needed = self.blocks_needed(total) - len(table) - len(computed_blocks)
        # Reviving a free cached block takes it out of the free queue.
        revived = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)
        if max(needed, 0) + revived > self.num_free_blocks:
            return False
        table = self.block_tables.setdefault(request.request_id, table)
        # The host tier's slots, read (and made the most recently used) before this
        # allocation's evictions store blocks there: a slot taken over by a store this step
        # still holds the old block when the step loads it (stores land after).
        slots = [self.host.lookup(key) for key in host_keys]
        for block in computed_blocks:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1
            table.append(block)
        if computed_blocks:
            self._num_cached_blocks[request.request_id] = len(table)
        for _ in range(max(needed, 0)):
            block, _ = self.free_queue.popitem(last=False)
            key = self.block_keys[block]
            if key is not None:  # evict the least recently freed cached block
                del self.cached[key]
                self.block_keys[block] = None
                self._offload(block, key)
            self.ref_counts[block] = 1
            table.append(block)
        if host_keys:
            fresh = table[len(computed_blocks) : len(computed_blocks) + len(host_keys)]
            self._load(fresh, host_keys, slots)
            self._num_cached_blocks[rid] = len(computed_blocks) + len(host_keys)
        self._host_hits.pop(rid, None)
        return True

    def _offload(self, block: int, key: bytes) -> None:
        """An evicted cached block goes to the host tier, unless it is there already."""
        if self.host is None:
            return
        if any(b == block for _, b in self._loads):
            # Loaded by this step and evicted again before it ran: its data never arrived.
            self._loads = [(slot, b) for slot, b in self._loads if b != block]
            return
        if self.host.lookup(key) is None:
            self._stores.append((block, self.host.store(key)))

    def _load(self, blocks: list[int], keys: list[bytes], slots: list[int]) -> None:
        """Host-tier hits (`keys`, in `slots`) copied into fresh device `blocks`, keyed at once
        (the copy runs before the step's forward pass, which may already read them)."""
        for block, key, slot in zip(blocks, keys, slots, strict=True):
            self._loads.append((slot, block))
            self.cached[key] = block
            self.block_keys[block] = key
        self.host.num_loaded += len(blocks)
        self.host.hit_tokens += len(blocks) * self.page_size

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies the step being built needs, stores then loads (see `HostBlockPool`)."""
        stores, loads = self._stores, self._loads
        self._stores, self._loads = [], []
        return stores, loads

    def free(self, request: Request) -> None:
        """Releases the request's blocks (last first); cached ones stay findable until evicted."""
        rid = request.request_id
        for block in reversed(self.block_tables.pop(rid, [])):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
        self._num_cached_blocks.pop(rid, None)

    def forget(self, request: Request) -> None:
        """Drops the per-request memos once the request is gone for good."""
        self._hashes.pop(request.request_id, None)
        self._host_hits.pop(request.request_id, None)

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def check_invariants(self) -> None:
        """free + used = total; ref counts equal the number of tables holding a block; a block
        is free exactly when unreferenced; the cache map and the block keys agree."""
        owners = [0] * self.num_pages
        for table in self.block_tables.values():
            assert len(set(table)) == len(table), "a block appears twice in one block table"
            for block in table:
                owners[block] += 1
        used = sum(1 for c in self.ref_counts if c > 0)
        assert used + self.num_free_blocks == self.num_pages, "free + used != total"
        for block in range(self.num_pages):
            assert owners[block] == self.ref_counts[block], f"block {block}: ref count mismatch"
            assert (block in self.free_queue) == (owners[block] == 0), f"block {block}: free/used"
        for key, block in self.cached.items():
            assert self.block_keys[block] == key, f"block {block}: cache map disagrees"
        assert sum(k is not None for k in self.block_keys) == len(self.cached), "stray block key"

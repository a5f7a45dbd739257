"""The pool of KV cache pages, each request's block tables, and automatic prefix caching.

Pages ("blocks") hold `page_size` tokens of one layer group (`jaxllm.worker.kv_groups`: all layers,
for most models). A request owns one block table per group, which grow together as its tokens
are scheduled and are released when it finishes, is aborted or is preempted. Blocks carry
reference counts because a block can be shared.

A sliding-window group's table drops the blocks wholly behind the window of the request's next
token (a null entry, `NULL_BLOCK`, takes their place, so every group's table keeps one entry
per block of the sequence): they go back to the pool as any freed block does, cached ones
still findable.

Prefix caching: once a block is full, its key is a hash chained from the parent block's key,
the block's token ids and what else decides its K/V (vLLM's block hash, `block_hashing.py`), so
equal keys mean equal prefixes. A new request looks its blocks'
keys up in order and reuses the longest run of hits: those tokens start out computed. Each
group caches its own blocks under the same keys; a hit must be found in every full group, and
in each sliding group only for the blocks the window after it sees (vLLM's hybrid lookup). A
released block keeps its key and waits in an LRU free queue: a later hit revives it, and it is
evicted (its key dropped) only when a new block is needed and it is the least recently freed.
A request's blocks are released last-first, so the tail of a sequence, the part least likely
to be shared, is evicted before its head.

With a host tier (`HostBlockPool`, `--kv-offloading-size`), an evicted cached block is copied to
host memory under its key, and a lookup goes on past the device's hits into the host's: those
blocks get fresh device blocks, keyed at once, which the step copies back before it runs. The
copies each step needs are taken with `take_transfers` into the scheduler's output.

With KV events on (`kv_events.py`), the books' changes are told as they happen: blocks keyed
(`BlockStored`, in the device's medium, or the host's when a block is copied there), keys
dropped (`BlockRemoved`), the cache reset (`AllBlocksCleared`).

A hybrid model's linear-attention layers keep a state per request instead of pages: with
saved states (`StateSnapshots`) a hit is cut to the longest prefix whose state was saved too,
and the hit says which saved state the request starts from (`CacheHit.state`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import NamedTuple

from jaxllm.engine.block_hashing import BlockHasher, block_extra_keys, external_hash
from jaxllm.engine.host_blocks import HostBlockPool
from jaxllm.engine.kv_events import MEDIUM_CPU, MEDIUM_GPU, KVEventCollector
from jaxllm.engine.request import Request
from jaxllm.engine.state_snapshots import StateSnapshots

NULL_BLOCK = -1
"""A table entry with no block: in a sliding group, a block behind the window (freed, or never
taken on a prefix-cache hit). Sent to the runner as page 0, which no kernel reads there."""

# A block's key in the cache map and the host tier: (group, hash of the prefix).
Key = tuple[int, bytes]


def _key(block_hash: bytes, lora) -> bytes:
    """The cache's key for a block of vLLM hash `block_hash`: the hash itself, or under a LoRA
    adapter the hash with the adapter's id. vLLM's hash names an adapter by its name alone,
    and a name unloaded and loaded again from another checkpoint is another adapter, whose
    blocks must not hit the old one's."""
    if lora is None:
        return block_hash
    return hashlib.sha256(block_hash + lora.lora_int_id.to_bytes(8, "big")).digest()


class _Stored(NamedTuple):
    """What a BlockStored event says of a cached block: its vLLM hash, its parent's, ..."""

    external: bytes
    parent: bytes | None
    token_ids: list[int]
    lora: object  # the request's LoRARequest, or None
    extra_keys: tuple | None


class KVCacheManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        windows: tuple[int | None, ...] = (None,),
        enable_prefix_caching: bool = True,
        host: HostBlockPool | None = None,
        snapshots: StateSnapshots | None = None,
        hasher: BlockHasher | None = None,
        events: bool = False,
        drop_last_hit_block: bool = False,
    ):
        """`windows`: per layer group (`KVCacheGroups.windows`), its sliding window or None.
        `snapshots`: a hybrid model's saved states (with prefix caching). `hasher`: the
        block hash (default vLLM's default, sha256); `events`: collect KV events
        (`take_events`). `drop_last_hit_block`: a hit gives up its last block, computed
        again (an EAGLE-3 head's KV at a position is computed with the token after it,
        which a request sharing only the prefix does not share; vLLM does the same)."""
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.windows = windows
        self._sliding = any(w is not None for w in windows)  # a group frees behind a window
        self.enable_prefix_caching = enable_prefix_caching
        self.drop_last_hit_block = drop_last_hit_block
        self.ref_counts = [0] * num_pages
        self.block_keys: list[Key | None] = [None] * num_pages
        # Free blocks, least recently freed first; cached ones keep their key until evicted.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self.cached: dict[Key, int] = {}  # key -> block holding that prefix in that group
        self.block_tables: dict[str, list[list[int]]] = {}  # per request, per group
        self._num_cached_blocks: dict[str, int] = {}  # per request: leading blocks keyed
        self._first_live: dict[str, list[int]] = {}  # per request, per group: before it, null
        self._hashes: dict[str, list[bytes]] = {}  # per request: keys of its full blocks
        self._chains: dict[str, list[bytes]] = {}  # per request: their vLLM hashes
        self.hasher = hasher or BlockHasher()
        self.events = KVEventCollector(page_size) if events else None
        # With events: each cached hash's (parent, token ids, LoRA), for telling the host
        # tier's copy of it.
        self._stored: dict[bytes, _Stored] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found (on the device or in the host tier)
        self.host = host
        self.snapshots = snapshots
        # This step's copies: (device block, host slot) stores, (host slot, device block) loads.
        self._stores: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        # Finished requests' tables kept for a decoder to read (`hold`), by hold id.
        self._held: dict[int, list[list[int]]] = {}
        self._next_hold = 0

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _first_visible_block(self, group: int, position: int) -> int:
        """The first block a query at `position` (or after it) reads in `group`."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, position - window + 1) // self.page_size

    # ---- prefix cache ----------------------------------------------------------------

    def _block_hashes(self, request: Request) -> list[bytes]:
        """Keys of the request's full blocks (`_key` of their vLLM hashes), extended as its
        tokens grow."""
        hashes = self._hashes.setdefault(request.request_id, [])
        chain = self._chains.setdefault(request.request_id, [])
        tokens, size = request.all_token_ids, self.page_size
        while (len(chain) + 1) * size <= len(tokens):
            i = len(chain)
            parent = chain[-1] if chain else None
            extra = block_extra_keys(request, i * size, (i + 1) * size)
            chain.append(self.hasher.hash_block(parent, tokens[i * size : (i + 1) * size], extra))
            hashes.append(_key(chain[-1], request.lora))
        return hashes

    def _found(self, key: Key) -> bool:
        return key in self.cached or (self.host is not None and key in self.host)

    def get_computed_blocks(self, request: Request) -> tuple[CacheHit | None, int]:
        """The longest cached prefix of the request: (its blocks, number of tokens), for
        `allocate_slots`. A block is found on the device or, with a host tier, in host memory
        (then `allocate_slots` gives it a fresh device block that the step loads).

        At least one token is always left to compute: the step must produce logits."""
        if not self.enable_prefix_caching:
            return None, 0
        max_blocks = (request.num_tokens - 1) // self.page_size
        hashes = self._block_hashes(request)[:max_blocks]
        n = len(hashes)
        for g, window in enumerate(self.windows):  # every full group: a run from the start
            if window is None:
                n = next((i for i, h in enumerate(hashes[:n]) if not self._found((g, h))), n)
        if self.drop_last_hit_block:
            n = max(n - 1, 0)
        sliding = [g for g, w in enumerate(self.windows) if w is not None]
        # Each sliding group: the blocks the window after the hit sees, found; shrink the hit
        # until every group agrees (a hit that suits one group may not suit another).
        # With saved states, the hit must also end where a state was saved.
        runs = {g: _runs([self._found((g, h)) for h in hashes[:n]]) for g in sliding}
        snapshots = self.snapshots
        while True:
            m = n
            for g in sliding:
                while m and runs[g][m - 1] < m - self._first_visible_block(g, m * self.page_size):
                    m -= 1
            while snapshots is not None and m and snapshots.find(hashes[m - 1]) is None:
                m -= 1
            if m == n:
                break
            n = m
        if n == 0:
            return None, 0
        hit = CacheHit(
            [
                [
                    None if i < self._first_visible_block(g, n * self.page_size) else (g, h)
                    for i, h in enumerate(hashes[:n])
                ]
                for g in range(self.num_groups)
            ],
            None if snapshots is None else snapshots.find(hashes[n - 1]),
        )
        return hit, n * self.page_size

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
        # Speculative decoding: a stop inside accepted drafts leaves confirmed tokens that
        # were never appended (the ones after the stop).
        confirmed = min(request.num_confirmed_tokens, request.num_tokens)
        start = self._num_cached_blocks.get(rid, 0)
        if confirmed // self.page_size <= start:
            return  # no block became full (most steps)
        tables = self.block_tables.get(rid)
        if tables is None:
            return
        end = min(confirmed // self.page_size, len(tables[0]))
        if end <= start:
            return
        hashes = self._block_hashes(request)
        for g, table in enumerate(tables):
            keyed = []
            for i in range(start, end):
                block, key = table[i], (g, hashes[i])
                if block == NULL_BLOCK:  # freed behind the window before it was computed
                    continue
                if key not in self.cached and self.block_keys[block] is None:
                    self.cached[key] = block
                    self.block_keys[block] = key
                    keyed.append(i)
                # Else an equal block is cached already (computed concurrently): this one
                # stays a plain block and returns to the pool uncached.
            if self.events is not None:
                self._tell_stored(request, g, keyed, MEDIUM_GPU)
        self._num_cached_blocks[rid] = end

    def _tell_stored(self, request: Request, group: int, blocks: list[int], medium: str) -> None:
        """BlockStored events for the request's blocks `blocks` (ascending) of `group`: one
        per run of consecutive blocks, its parent the block before the run. Each block's
        parent, tokens, adapter and extra keys are kept while it is cached, to tell the host
        tier's copy later."""
        rid, tokens, size = request.request_id, request.all_token_ids, self.page_size
        keys, chain = self._hashes[rid], self._chains[rid]
        runs: list[list[int]] = []
        for i in blocks:
            start = i * size
            self._stored[keys[i]] = _Stored(
                chain[i],
                chain[i - 1] if i else None,
                tokens[start : start + size],
                request.lora,
                block_extra_keys(request, start, start + size),
            )
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            self._emit_stored([keys[i] for i in run], medium, group)

    def _emit_stored(self, run: list[bytes], medium: str, group: int) -> None:
        """One BlockStored event for consecutive blocks `run` of one chain."""
        blocks = [self._stored[h] for h in run]
        first, lora = blocks[0], blocks[0].lora
        extra = [b.extra_keys for b in blocks]
        self.events.stored(
            [external_hash(b.external) for b in blocks],
            None if first.parent is None else external_hash(first.parent),
            [t for b in blocks for t in b.token_ids],
            medium=medium,
            group=group,
            lora_id=None if lora is None else lora.lora_int_id,
            lora_name=None if lora is None else lora.lora_name,
            extra_keys=extra if any(e is not None for e in extra) else None,
        )

    def _external(self, key_hash: bytes) -> int:
        """A cached key's vLLM hash as events carry it."""
        stored = self._stored.get(key_hash)
        return external_hash(key_hash if stored is None else stored.external)

    def _forget_stored(self, block_hash: bytes) -> None:
        """Drops a hash's memo once no group holds it on the device or the host."""
        if any((g, block_hash) in self.cached for g in range(self.num_groups)):
            return
        if self.host is not None and any(
            (g, block_hash) in self.host for g in range(self.num_groups)
        ):
            return
        self._stored.pop(block_hash, None)

    def take_events(self) -> list:
        """The KV events since the last call (none when events are off)."""
        return [] if self.events is None else self.events.take()

    def save_state(self, request: Request, end: int) -> int:
        """The snapshot slot that gets the request's state after a chunk ending at `end` (see
        `state_snapshots`): one when the chunk ends at a page boundary whose state is not
        saved already (as far as the host knows the tokens yet); -1: none."""
        snapshots, page = self.snapshots, self.page_size
        if snapshots is None or end % page or request.pooled is not None:
            return -1  # (pooled prompts are never looked up)
        hashes = self._block_hashes(request)
        if len(hashes) >= end // page and snapshots.find(hashes[end // page - 1]) is not None:
            return -1
        slot = snapshots.take(request.request_id, end)
        return -1 if slot is None else slot

    def state_source(self, request: Request) -> int:
        """The snapshot slot the request's next chunk reads its state from because its last
        chunk saved it there; -1: its own slot."""
        return -1 if self.snapshots is None else self.snapshots.leave(request.request_id)

    def commit_state(self, request: Request, slot: int) -> None:
        """The step that saved the request's state into `slot` has run: keyed by its prefix."""
        boundary = self.snapshots.pending.get(request.request_id, {}).get(slot)
        if boundary is None:
            return  # released since (the request was preempted)
        key = self._block_hashes(request)[boundary // self.page_size - 1]
        decoding = boundary > request.num_prompt_tokens
        self.snapshots.commit(request.request_id, slot, key, decoding=decoding)

    def reset_prefix_cache(self, *, host: bool = True) -> bool:
        """Forgets every cached prefix, in the host tier too unless `host` is off (sleep:
        the device's cache is dropped, the host's copies stay right). Only possible while no
        block is in use (as in vLLM)."""
        if self.num_free_blocks != self.num_pages:
            return False
        dropped = list(self.cached)
        self.cached.clear()
        self.block_keys = [None] * self.num_pages
        if self.host is not None and host:
            self.host.clear()
        if self.events is not None:
            if self.host is None or host:
                self.events.cleared()
                self._stored.clear()
            else:  # the host tier's copies stay findable: only the device's go
                for g, block_hash in dropped:
                    self.events.removed([self._external(block_hash)], medium=MEDIUM_GPU, group=g)
                    self._forget_stored(block_hash)
        if self.snapshots is not None:
            self.snapshots.clear()
        return True

    # ---- allocation ------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit: CacheHit | None = None,
        *,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Grows the request's block tables to hold `num_computed_tokens + num_new_tokens`
        tokens and `num_lookahead_tokens` more (a draft model's drafts), starting, for a new
        request, with `hit` (`get_computed_blocks`): its device blocks, and fresh blocks for
        its host-tier blocks (loaded by this step). A running request's sliding groups first
        release the blocks behind the window of its next token. Returns False, changing
        nothing else, when the pool has too few free blocks."""
        rid = request.request_id
        tables = self.block_tables.get(rid)
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if tables is not None and not self._sliding and total <= len(tables[0]) * self.page_size:
            return True  # a running request within its blocks (most decodes): nothing to do
        if tables is None:
            entries = hit.entries if hit is not None else [[] for _ in self.windows]
            located = [[self._locate(key) for key in group] for group in entries]
            length = len(entries[0])
        else:
            self._free_skipped(request)
            located, length = None, len(tables[0])
        fresh = max(self.blocks_needed(total) - length, 0) * self.num_groups
        if located is not None:
            # A host-tier block takes a fresh block; reviving a free cached one takes it out
            # of the free queue.
            fresh += sum(
                loc is not None and (loc[0] == "host" or self.ref_counts[loc[1]] == 0)
                for g in located
                for loc in g
            )
        if fresh > self.num_free_blocks:
            return False
        if located is not None:
            tables = self.block_tables[rid] = self._take_hit(rid, entries, located)
            if hit is not None and hit.state is not None:
                self.snapshots.use(hit.state)
            if self.events is not None:  # the host tier's blocks, now on the device too
                for g, group_locs in enumerate(located):
                    loaded = [i for i, loc in enumerate(group_locs) if loc and loc[0] == "host"]
                    self._tell_stored(request, g, loaded, MEDIUM_GPU)
            self._first_live[rid] = [
                next((i for i, b in enumerate(t) if b != NULL_BLOCK), len(t)) for t in tables
            ]
        for table in tables:
            for _ in range(self.blocks_needed(total) - len(table)):
                table.append(self._pop_free())
        return True

    def _locate(self, key: Key | None) -> tuple[str, int] | None:
        """Where a hit's block is: ("device", block), ("host", slot), or None (not needed).
        Reading a host slot makes it the most recently used, before this allocation's
        evictions store blocks there: a slot taken over by a store this step still holds
        the old block when the step loads it (stores land after loads)."""
        if key is None:
            return None
        block = self.cached.get(key)
        if block is not None:
            return ("device", block)
        return ("host", self.host.lookup(key))

    def _take_hit(self, rid: str, entries, located) -> list[list[int]]:
        """A new request's tables from its cache hit: device blocks held, host-tier blocks
        copied into fresh device blocks (keyed at once: the copy runs before the step's
        forward pass, which may already read them)."""
        tables = []
        for group_locs in located:
            table = []
            for loc in group_locs:
                if loc is None:
                    table.append(NULL_BLOCK)
                elif loc[0] == "device":
                    block = loc[1]
                    if self.ref_counts[block] == 0:
                        del self.free_queue[block]
                    self.ref_counts[block] += 1
                    table.append(block)
                else:
                    table.append(None)  # placeholder: filled after the device hits are held
            tables.append(table)
        loaded = set()  # the positions of the blocks copied back (in any group)
        for table, group_keys, group_locs in zip(tables, entries, located, strict=True):
            for i, (key, loc) in enumerate(zip(group_keys, group_locs, strict=True)):
                if loc is not None and loc[0] == "host":
                    block = table[i] = self._pop_free()
                    self._loads.append((loc[1], block))
                    self.cached[key] = block
                    self.block_keys[block] = key
                    self.host.num_loaded += 1
                    loaded.add(i)
        if loaded:
            self.host.hit_tokens += len(loaded) * self.page_size
        self._num_cached_blocks[rid] = len(tables[0])
        return tables

    def _pop_free(self) -> int:
        """The least recently freed block, evicting its cached prefix (to the host tier)."""
        block, _ = self.free_queue.popitem(last=False)
        key = self.block_keys[block]
        if key is not None:
            del self.cached[key]
            self.block_keys[block] = None
            self._offload(block, key)
            if self.events is not None:
                self.events.removed([self._external(key[1])], medium=MEDIUM_GPU, group=key[0])
                self._forget_stored(key[1])
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_queue[block] = None

    def _free_skipped(self, request: Request) -> None:
        """Releases the sliding groups' blocks that no query from the request's next token on
        sees, once they are keyed where they will be (a later request with the same prefix
        needs the ones before its hit's end; async scheduling keys a step's blocks a step
        late). The step in flight may still read them: it runs before any step that writes
        a block given out again."""
        rid = request.request_id
        tables, first_live = self.block_tables[rid], self._first_live[rid]
        keyed = len(tables[0])
        if self.enable_prefix_caching and request.pooled is None:
            keyed = self._num_cached_blocks.get(rid, 0)
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            visible = self._first_visible_block(g, request.num_computed_tokens)
            end = min(visible, keyed, len(tables[g]))
            table = tables[g]
            for i in range(first_live[g], end):
                if table[i] != NULL_BLOCK:
                    self._release(table[i])
                    table[i] = NULL_BLOCK
            first_live[g] = max(first_live[g], end)

    def _offload(self, block: int, key: Key) -> None:
        """An evicted cached block goes to the host tier, unless it is there already."""
        if self.host is None:
            return
        if any(b == block for _, b in self._loads):
            # Loaded by this step and evicted again before it ran: its data never arrived.
            self._loads = [(slot, b) for slot, b in self._loads if b != block]
            return
        if self.host.lookup(key) is None:
            self._stores.append((block, self._host_store(key)))
            if self.events is not None and key[1] in self._stored:
                self._emit_stored([key[1]], MEDIUM_CPU, key[0])

    def _host_store(self, key: Key) -> int:
        """A host slot for `key`'s block, evicting the least recently used key (told to KV
        event subscribers) when every slot is held."""
        victim = self.host.next_victim()
        slot = self.host.store(key)
        if self.events is not None and victim is not None:
            self.events.removed([self._external(victim[1])], medium=MEDIUM_CPU, group=victim[0])
            self._forget_stored(victim[1])
        return slot

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies the step being built needs, stores then loads (see `HostBlockPool`)."""
        stores, loads = self._stores, self._loads
        self._stores, self._loads = [], []
        return stores, loads

    def free(self, request: Request) -> None:
        """Releases the request's blocks, the sequence's last first in every group (the tail,
        least likely shared, is evicted first); cached ones stay findable until evicted."""
        self._release_tables(self._take_tables(request))

    def _take_tables(self, request: Request) -> list[list[int]] | None:
        """The request's tables, taken from it with its other holdings (how far they are
        keyed, where they start, a saved state under way)."""
        rid = request.request_id
        self._num_cached_blocks.pop(rid, None)
        self._first_live.pop(rid, None)
        if self.snapshots is not None:
            self.snapshots.release(rid)
        return self.block_tables.pop(rid, None)

    def _release_tables(self, tables: list[list[int]] | None) -> None:
        """Releases a request's blocks, the sequence's last first in every group."""
        if tables:
            for i in range(len(tables[0]) - 1, -1, -1):
                for table in tables:
                    if table[i] != NULL_BLOCK:
                        self._release(table[i])

    def forget(self, request: Request) -> None:
        """Drops the per-request memos once the request is gone for good."""
        self._hashes.pop(request.request_id, None)
        self._chains.pop(request.request_id, None)
        if self.snapshots is not None:
            self.snapshots.forget(request.request_id)

    # ---- prefill/decode disaggregation (`kv_transfer.py`) ------------------------------

    def block_chain(self, request: Request) -> list[bytes]:
        """The vLLM hashes of the request's full blocks (what another engine's books call
        them, if it hashes alike)."""
        self._block_hashes(request)
        return list(self._chains[request.request_id])

    def hold(self, request: Request) -> int:
        """Takes a finishing request's blocks out of its hands without freeing them: they stay
        out of the pool, cached ones findable, until `release_hold` of the returned id (a
        decoder reads them meanwhile). The caller forgets the request as usual."""
        tables = self._take_tables(request) or [[] for _ in self.windows]
        hold, self._next_hold = self._next_hold, self._next_hold + 1
        self._held[hold] = tables
        return hold

    def release_hold(self, hold: int) -> None:
        """Frees the blocks `hold` kept, the sequence's last first (as `free`)."""
        self._release_tables(self._held.pop(hold, None))

    def land_pulled(self, request: Request, blocks: list[tuple[int, int]]) -> list[int]:
        """Host-tier slots for blocks another engine computed for this request ((group, index)
        each), keyed as the request's own would be, so its prefix lookup finds them there: per
        block, the slot its data goes to, or -1 where none is needed (cached here already) or
        none is left (more blocks than the tier holds: the first ones are kept, a prefix being
        found from the start). The caller writes the data before the next step."""
        hashes = self._block_hashes(request)
        # The request's own blocks before the pulled ones, found in the host tier, become the
        # most recently used: landing must not evict the prefix it continues.
        first = min((i for _, i in blocks), default=0)
        kept = sum(
            self.host.lookup((g, h)) is not None for g in range(self.num_groups) for h in hashes[:first]
        )  # fmt: skip
        slots, landed, room = [], {}, self.host.num_blocks - kept
        for g, i in blocks:
            key = (g, hashes[i])
            if self._found(key) or not room:
                slots.append(-1)
                continue
            slots.append(self._host_store(key))
            landed.setdefault(g, []).append(i)
            room -= 1
        if self.events is not None:
            for g, indices in landed.items():
                self._tell_stored(request, g, sorted(indices), MEDIUM_CPU)
        return slots

    def get_block_table(self, request_id: str) -> list[list[int]]:
        """The request's table per group (`NULL_BLOCK` where a sliding group holds none)."""
        return self.block_tables.get(request_id) or [[] for _ in self.windows]

    def num_live_blocks(self, request_id: str) -> int:
        """The blocks the request holds, over all groups."""
        tables = self.block_tables.get(request_id, [])
        return sum(b != NULL_BLOCK for table in tables for b in table)

    def check_invariants(self) -> None:
        """free + used = total; ref counts equal the number of tables holding a block; a block
        is free exactly when unreferenced; the cache map and the block keys agree; every
        group's table as long as the others."""
        owners = [0] * self.num_pages
        for tables in [*self.block_tables.values(), *self._held.values()]:
            assert len(tables) == self.num_groups, "a request without a table per group"
            assert len({len(t) for t in tables}) == 1, "groups' tables of different lengths"
            held = [b for table in tables for b in table if b != NULL_BLOCK]
            assert len(set(held)) == len(held), "a block appears twice in one request's tables"
            for block in held:
                owners[block] += 1
        used = sum(1 for c in self.ref_counts if c > 0)
        assert used + self.num_free_blocks == self.num_pages, "free + used != total"
        for block in range(self.num_pages):
            assert owners[block] == self.ref_counts[block], f"block {block}: ref count mismatch"
            assert (block in self.free_queue) == (owners[block] == 0), f"block {block}: free/used"
        for key, block in self.cached.items():
            assert self.block_keys[block] == key, f"block {block}: cache map disagrees"
        assert sum(k is not None for k in self.block_keys) == len(self.cached), "stray block key"
        if self.snapshots is not None:
            self.snapshots.check_invariants()
            saving = set(self.snapshots.pending) | set(self.snapshots.standing)
            assert saving <= set(self.block_tables), "a gone request holds a saved state"


class CacheHit:
    """A prefix-cache hit, from `get_computed_blocks` to `allocate_slots`: per group, per block
    of the prefix, its key, or None where a sliding group needs no block; and with saved
    states, the snapshot slot of the state after the prefix."""

    __slots__ = ("entries", "state")

    def __init__(self, entries: list[list[Key | None]], state: int | None = None):
        self.entries = entries
        self.state = state


def _runs(found: list[bool]) -> list[int]:
    """Per index, how many consecutive True end there."""
    runs, run = [], 0
    for f in found:
        run = run + 1 if f else 0
        runs.append(run)
    return runs

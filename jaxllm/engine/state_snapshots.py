"""Saved recurrent states: what makes a hybrid model's prefix cache (vLLM's "align" mode).

A linear-attention layer keeps no pages: its state after a prefix is one matrix per request,
overwritten by every step. A prefix served from the cache needs that state as it was at the
prefix's end, so the engine saves it at page boundaries into snapshot slots (extra slots of
the model cache's `LinearState`, after the batch rows) and keys each by the prefix's block key
(`block_hashing.BlockHasher`). A cache hit is then cut to the longest prefix whose attention
blocks are cached and whose state was saved (`KVCacheManager.get_computed_blocks`); a prefix
without one is recomputed, never started from a wrong state.

When a state is saved: a step whose chunk of a request ends at a page boundary writes the
request's state after the chunk to a snapshot slot instead of its own (`StateSlots.write`),
and its next chunk reads it from there and writes its own slot again: a save costs the step
nothing (copy on write; the slot is held until that next chunk is scheduled, `leave`). The
scheduler makes prompts' chunks end at page boundaries, and at the last boundary before the
sequence's end (`Scheduler._align_for_state`: vLLM's block-aligned split); a decode ends on
one every `page_size` tokens.

A save is pending until the step that makes it has run (`commit`, from the scheduler's update
of that step): only then is it keyed and found, so a step can never read a slot that an
earlier step has not finished writing. A request keeps its prompt's snapshots in the cache and,
of those taken while it decodes, only its latest (the one a returning conversation needs):
each replaces the one before. Slots are reused least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_state_snapshots must be >= 1 here, got {num_slots}")
        self.num_slots = num_slots
        # Slots not pending a save, least recently used first; keyed ones are findable.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))
        self.keys: list[bytes | None] = [None] * num_slots
        self.cached: dict[bytes, int] = {}  # prefix key -> slot holding the state after it
        self.pending: dict[str, dict[int, int]] = {}  # per request: slot -> boundary (tokens)
        # Per request: the slot its state is in after its last save, until its next chunk
        # (which reads it) is scheduled.
        self.standing: dict[str, int] = {}
        # Per request: its latest snapshot taken past its prompt, (slot, key).
        self._decode_snapshot: dict[str, tuple[int, bytes]] = {}
        self.num_saved = 0  # states keyed since start
        self.num_hits = 0  # prefix-cache hits served from a saved state

    def find(self, key: bytes) -> int | None:
        return self.cached.get(key)

    def use(self, slot: int) -> None:
        """A hit reads the slot this step: it becomes the most recently used."""
        self.free.move_to_end(slot)
        self.num_hits += 1

    def take(self, request_id: str, boundary: int) -> int | None:
        """A slot for the request's state after `boundary` tokens, saved by the step being
        built: the least recently used, its old state forgotten. None when every slot is
        pending (no save this time)."""
        if not self.free:
            return None
        slot, _ = self.free.popitem(last=False)
        self._forget(slot)
        self.pending.setdefault(request_id, {})[slot] = boundary
        self.standing[request_id] = slot
        return slot

    def leave(self, request_id: str) -> int:
        """The request's next chunk is scheduled: the slot its state is in after its last
        save (-1: none, it is in its own), which that chunk reads. The slot is held no longer
        (once its save is committed)."""
        slot = self.standing.pop(request_id, -1)
        if slot >= 0 and slot not in self.pending.get(request_id, ()):
            self.free[slot] = None
        return slot

    def commit(self, request_id: str, slot: int, key: bytes, *, decoding: bool) -> None:
        """The step that saved into `slot` has run: the state after the prefix `key` is
        there. A slot no longer pending for the request (released when it was preempted or
        finished) is ignored. `decoding`: taken past the prompt, replacing the request's
        previous such snapshot."""
        pending = self.pending.get(request_id)
        if pending is None or slot not in pending:
            return
        del pending[slot]
        if not pending:
            del self.pending[request_id]
        held = self.standing.get(request_id) == slot  # the request's state is still there
        if key in self.cached:  # an equal state is saved already: this slot goes first
            if not held:
                self.free[slot] = None
                self.free.move_to_end(slot, last=False)
            return
        self.keys[slot] = key
        self.cached[key] = slot
        if not held:
            self.free[slot] = None
        self.num_saved += 1
        if decoding:
            previous = self._decode_snapshot.get(request_id)
            if (
                previous is not None
                and self.keys[previous[0]] == previous[1]
                and previous[0] in self.free
            ):
                self._forget(previous[0])
                self.free.move_to_end(previous[0], last=False)
            self._decode_snapshot[request_id] = (slot, key)

    def release(self, request_id: str) -> None:
        """The request left the batch (finished, aborted or preempted): its pending slots go
        back, first in line and unkeyed (the saves still in flight land in no slot anyone
        reads); the slot it held after a committed save goes back keyed (still findable)."""
        pending = self.pending.pop(request_id, {})
        for slot in pending:
            self.free[slot] = None
            self.free.move_to_end(slot, last=False)
        slot = self.standing.pop(request_id, -1)
        if slot >= 0 and slot not in pending:  # its save was committed: it stays cached
            self.free[slot] = None

    def forget(self, request_id: str) -> None:
        """Drops the per-request memo once the request is gone for good."""
        self._decode_snapshot.pop(request_id, None)

    def clear(self) -> None:
        """Forgets every saved state (the prefix cache was reset)."""
        for slot in list(self.cached.values()):
            self._forget(slot)

    def _forget(self, slot: int) -> None:
        key = self.keys[slot]
        if key is not None:
            del self.cached[key]
            self.keys[slot] = None

    @property
    def num_pending(self) -> int:
        return sum(len(p) for p in self.pending.values())

    def check_invariants(self) -> None:
        """Every slot is free or held (pending a save, or holding a request's state), never
        both; the key map and the slots agree."""
        pending = [slot for p in self.pending.values() for slot in p]
        assert len(set(pending)) == len(pending), "a slot pending twice"
        held = set(pending) | set(self.standing.values())
        assert len(set(self.standing.values())) == len(self.standing), "a slot held twice"
        assert not held & set(self.free), "a slot both held and free"
        assert len(held) + len(self.free) == self.num_slots, "free + held != total"
        for key, slot in self.cached.items():
            assert self.keys[slot] == key, f"snapshot slot {slot}: key map disagrees"
            assert slot not in pending, f"snapshot slot {slot}: keyed while pending"
        assert sum(k is not None for k in self.keys) == len(self.cached), "stray snapshot key"

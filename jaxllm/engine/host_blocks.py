"""The host-RAM tier of the prefix cache (vLLM's `--kv-offloading-size`): which full blocks'
keys are kept in host memory, in which slot, least recently used first.

A cached block evicted from the device pool is copied to a host slot under the same key (the
SHA-256 chain of `kv_cache_manager`), and a request whose prefix misses on the device but hits
here gets fresh device blocks that the step copies back before it runs, instead of recomputing
them. This class only keeps the books; the copies are the runner's (`jaxllm.worker.kv_offload`),
which the scheduler's output names per step: `(device block, host slot)` pairs to store and
`(host slot, device block)` pairs to load.
"""

from __future__ import annotations

from collections import OrderedDict


class HostBlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recent first
        self._free = list(range(num_blocks - 1, -1, -1))
        # Counters since start, for metrics.
        self.num_stored = 0  # blocks copied to the host
        self.num_loaded = 0  # blocks copied back to the device
        self.hit_tokens = 0  # prefix-cache hits served from this tier, in tokens

    def __contains__(self, key: bytes) -> bool:
        return key in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def lookup(self, key: bytes) -> int | None:
        """The slot holding `key`'s block, or None; a hit becomes the most recently used."""
        slot = self.slots.get(key)
        if slot is not None:
            self.slots.move_to_end(key)
        return slot

    def next_victim(self) -> bytes | None:
        """The key `store` would evict now: the least recently used one when every slot is
        held, else None."""
        return None if self._free else next(iter(self.slots), None)

    def store(self, key: bytes) -> int:
        """A slot for `key`'s block (its data is written by the step that evicts it from the
        device), taking the least recently used one when every slot is held."""
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self.slots.popitem(last=False)
        self.slots[key] = slot
        self.num_stored += 1
        return slot

    def clear(self) -> None:
        self.slots.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))

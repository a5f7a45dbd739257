"""The pool of KV cache pages and each request's block table.

Pages ("blocks") are fixed-size: `page_size` tokens of every layer. A request owns a list of
block ids (its block table) that grows as its tokens are scheduled and is returned whole when
it finishes, is aborted, or is preempted. Reference counts are kept per block so that shared
(prefix-cached) blocks can be added without changing this interface.
"""

from __future__ import annotations

from collections import deque

from jaxllm.engine.request import Request


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.ref_counts = [0] * num_pages
        self.free_blocks: deque[int] = deque(range(num_pages))
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grows the request's block table to hold `num_computed_tokens + num_new_tokens`
        tokens. Returns False, allocating nothing, when the pool has too few free blocks."""
        table = self.block_tables.setdefault(request.request_id, [])
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(table)
        if needed > len(self.free_blocks):
            return False
        for _ in range(max(needed, 0)):
            block = self.free_blocks.popleft()
            assert self.ref_counts[block] == 0, f"block {block} is free but referenced"
            self.ref_counts[block] = 1
            table.append(block)
        return True

    def free(self, request: Request) -> None:
        """Returns the request's blocks to the pool (a no-op for a request that holds none)."""
        for block in reversed(self.block_tables.pop(request.request_id, [])):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def check_invariants(self) -> None:
        """free + used = total; no block both free and owned; ref counts match the owners."""
        owners = [0] * self.num_pages
        for table in self.block_tables.values():
            for block in table:
                owners[block] += 1
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is in the free queue twice"
        for block in range(self.num_pages):
            assert owners[block] == self.ref_counts[block], f"block {block}: ref count mismatch"
            assert (block in free) == (owners[block] == 0), f"block {block}: free/used mismatch"

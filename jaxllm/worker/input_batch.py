"""The runner's persistent batch: one row of host arrays per request in the batch.

A request's row is written once, from its `NewRequestData`, when it enters the batch (new, or
resumed after a preemption), and then updated in place: blocks appended from each step's
`ScheduledRequest`, sampled tokens appended by the runner itself. Building a step's device
inputs is then a handful of vectorized gathers over these rows instead of a Python loop over
every field of every request (vLLM V1's `InputBatch`).
"""

from __future__ import annotations

import numpy as np

from jaxllm.worker.mrope import mrope_positions
from jaxllm.worker.sampling_inputs import SamplingRows
from jaxllm.worker.step_data import NewRequestData, ScheduledRequest


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        pages_per_seq: int,
        vocab_size: int,
        num_kv_groups: int = 1,
        mrope: bool = False,
    ):
        """`mrope`: positions are M-RoPE triples (`jaxllm.worker.mrope`)."""
        n = max_num_reqs
        self.vocab_size = vocab_size
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(n - 1, -1, -1))  # pop() hands out the lowest row
        # Prompt then output ids; past num_tokens, vocab_size (an id the sampler drops).
        self.token_ids = np.full((n, max_model_len), vocab_size, np.int32)
        self.num_tokens = np.zeros(n, np.int32)
        self.num_prompt_tokens = np.zeros(n, np.int32)
        # Per layer group (`jaxllm.worker.kv_groups`), per row, its pages.
        self.block_table = np.zeros((num_kv_groups, n, pages_per_seq), np.int32)
        self.num_blocks = np.zeros(n, np.int32)
        self.lora_slot = np.full(n, -1, np.int32)  # each row's LoRA adapter slot; -1: none
        self.sampling = SamplingRows(n, vocab_size, max_model_len)
        # M-RoPE: a row's token i is at i + position_delta, the same in all three components,
        # except its prompt's tokens where `mrope_prompt` holds the row's [3, prompt] triples.
        self.mrope = mrope
        self.position_delta = np.zeros(n, np.int32)
        self.mrope_prompt: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.row_of)

    def add(self, new: NewRequestData) -> None:
        if new.request_id in self.row_of:
            raise ValueError(f"request {new.request_id!r} is already in the batch")
        if not self._free_rows:
            raise RuntimeError("the persistent batch is full: more requests than max_num_seqs")
        i = self._free_rows.pop()
        self.row_of[new.request_id] = i
        n = len(new.token_ids)
        self.token_ids[i, :n] = new.token_ids
        self.token_ids[i, n:] = self.vocab_size
        self.num_tokens[i] = n
        self.num_prompt_tokens[i] = new.num_prompt_tokens
        self.num_blocks[i] = 0
        self.lora_slot[i] = new.lora_slot
        self.position_delta[i] = 0
        self.mrope_prompt.pop(i, None)
        if self.mrope and new.mm_grids:
            positions, delta = mrope_positions(new.num_prompt_tokens, new.mm_grids)
            self.mrope_prompt[i], self.position_delta[i] = positions, delta
        self.append_blocks(i, new.block_ids)
        self.sampling.write(i, new)

    def remove(self, request_id: str) -> None:
        """Frees the request's row; an id not in the batch (it never ran) is ignored."""
        i = self.row_of.pop(request_id, None)
        if i is not None:
            self._free_rows.append(i)
            self.mrope_prompt.pop(i, None)

    def positions(self, rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """i32[3, T] M-RoPE positions of the tokens at indices `pos` of `rows`."""
        out = np.broadcast_to(pos + self.position_delta[rows], (3, len(pos))).copy()
        for row, prompt in self.mrope_prompt.items():
            mine = (rows == row) & (pos < prompt.shape[1])
            if mine.any():
                out[:, mine] = prompt[:, pos[mine]]
        return out

    def append_blocks(self, row: int, block_ids: list[list[int]]) -> None:
        """Appends each group's new blocks (as many in every group) to the row's tables."""
        n = len(block_ids[0]) if block_ids else 0
        if n:
            start = self.num_blocks[row]
            self.block_table[:, row, start : start + n] = block_ids
            self.num_blocks[row] = start + n

    def apply(self, requests: list[ScheduledRequest]) -> np.ndarray:
        """Appends each scheduled request's new blocks and writes its draft tokens after its
        last token (not counted in num_tokens); returns the rows, in batch order."""
        rows = np.fromiter((self.row_of[s.request_id] for s in requests), np.int32, len(requests))
        for row, s in zip(rows, requests, strict=True):
            self.append_blocks(row, s.new_block_ids)
            if s.spec_token_ids:
                n = self.num_tokens[row]
                self.token_ids[row, n : n + len(s.spec_token_ids)] = s.spec_token_ids
        return rows

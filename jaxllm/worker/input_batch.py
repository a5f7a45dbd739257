"""The runner's persistent batch: one row of host arrays per request in the batch.

A request's row is written once, from its `NewRequestData`, when it enters the batch (new, or
resumed after a preemption), and then updated in place: blocks appended from each step's
`ScheduledRequest`, sampled tokens appended by the runner itself. Building a step's device
inputs is then a handful of vectorized gathers over these rows instead of a Python loop over
every field of every request (vLLM V1's `InputBatch`).
"""

from __future__ import annotations

import numpy as np

from jaxllm.engine.step_data import NewRequestData, ScheduledRequest
from jaxllm.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

# Width of the per-request blocked-id array (EOS ids plus stop ids, while min_tokens holds).
MAX_BLOCKED_IDS = MAX_STOP_TOKEN_IDS + 16


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, pages_per_seq: int, vocab_size: int):
        n = max_num_reqs
        self.vocab_size = vocab_size
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(n - 1, -1, -1))  # pop() hands out the lowest row
        # Prompt then output ids; past num_tokens, vocab_size (an id the sampler drops).
        self.token_ids = np.full((n, max_model_len), vocab_size, np.int32)
        self.num_tokens = np.zeros(n, np.int32)
        self.num_prompt_tokens = np.zeros(n, np.int32)
        self.block_table = np.zeros((n, pages_per_seq), np.int32)
        self.num_blocks = np.zeros(n, np.int32)
        self.temperature = np.zeros(n, np.float32)
        self.top_k = np.zeros(n, np.int32)
        self.top_p = np.ones(n, np.float32)
        self.min_p = np.zeros(n, np.float32)
        self.seeds = np.zeros((n, 2), np.uint32)  # low and high words of the 64-bit seed
        self.num_logprobs = np.full(n, -1, np.int32)  # -1: no logprobs
        self.num_prompt_logprobs = np.zeros(n, np.int32)
        self.min_tokens = np.zeros(n, np.int32)
        self.blocked_ids = np.full((n, MAX_BLOCKED_IDS), vocab_size, np.int32)  # EOS, stop ids
        self.has_logit_bias = np.zeros(n, np.bool_)
        self.logit_bias_ids = np.full((n, MAX_LOGIT_BIAS), vocab_size, np.int32)
        self.logit_bias = np.zeros((n, MAX_LOGIT_BIAS), np.float32)
        self.uses_penalties = np.zeros(n, np.bool_)
        self.presence_penalty = np.zeros(n, np.float32)
        self.frequency_penalty = np.zeros(n, np.float32)
        self.repetition_penalty = np.ones(n, np.float32)

    def __len__(self) -> int:
        return len(self.row_of)

    def add(self, new: NewRequestData) -> None:
        if new.request_id in self.row_of:
            raise ValueError(f"request {new.request_id!r} is already in the batch")
        if not self._free_rows:
            raise RuntimeError("the persistent batch is full: more requests than max_num_seqs")
        i = self._free_rows.pop()
        self.row_of[new.request_id] = i
        p = new.sampling_params
        n = len(new.token_ids)
        self.token_ids[i, :n] = new.token_ids
        self.token_ids[i, n:] = self.vocab_size
        self.num_tokens[i] = n
        self.num_prompt_tokens[i] = new.num_prompt_tokens
        self.num_blocks[i] = 0
        self.append_blocks(i, new.block_ids)
        self.temperature[i] = p.temperature
        self.top_k[i] = p.top_k if p.top_k < self.vocab_size else 0  # all tokens: off
        self.top_p[i] = p.top_p
        self.min_p[i] = p.min_p
        seed = new.seed % 2**64
        self.seeds[i] = (seed & 0xFFFFFFFF, seed >> 32)
        self.num_logprobs[i] = -1 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[i] = p.prompt_logprobs or 0
        self.min_tokens[i] = min(p.min_tokens, self.token_ids.shape[1])  # past the end: all
        blocked = [*new.eos_token_ids, *(p.stop_token_ids or [])][:MAX_BLOCKED_IDS]
        self.blocked_ids[i] = self.vocab_size
        self.blocked_ids[i, : len(blocked)] = blocked
        bias = p.logit_bias or {}
        self.has_logit_bias[i] = bool(bias)
        self.logit_bias_ids[i] = self.vocab_size
        self.logit_bias[i] = 0.0
        self.logit_bias_ids[i, : len(bias)] = list(bias)
        self.logit_bias[i, : len(bias)] = list(bias.values())
        self.uses_penalties[i] = p.uses_penalties
        self.presence_penalty[i] = p.presence_penalty
        self.frequency_penalty[i] = p.frequency_penalty
        self.repetition_penalty[i] = p.repetition_penalty

    def remove(self, request_id: str) -> None:
        """Frees the request's row; an id not in the batch (it never ran) is ignored."""
        i = self.row_of.pop(request_id, None)
        if i is not None:
            self._free_rows.append(i)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = self.num_blocks[row]
            self.block_table[row, start : start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)

    def apply(self, requests: list[ScheduledRequest]) -> np.ndarray:
        """Appends each scheduled request's new blocks and writes its draft tokens after its
        last token (not counted in num_tokens); returns the rows, in batch order."""
        rows = np.fromiter((self.row_of[s.request_id] for s in requests), np.int32, len(requests))
        for row, s in zip(rows, requests, strict=True):
            if s.new_block_ids:
                self.append_blocks(row, s.new_block_ids)
            if s.spec_token_ids:
                n = self.num_tokens[row]
                self.token_ids[row, n : n + len(s.spec_token_ids)] = s.spec_token_ids
        return rows

    def append_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Appends one sampled token to each of `rows`."""
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1

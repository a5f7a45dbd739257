"""Pooling a decoder's final hidden states (a decoder served for pooling: Qwen3-Embedding's
last token, or the mean of its tokens): one more program per token bucket, run only in steps
that compute a pooling request's chunk, as the prompt scorer runs only when asked.

A pooling request is prefilled like any prompt, chunk by chunk under the step's token budget;
for each chunk this returns the sum of its tokens' hidden states and its last token's, and the
scheduler carries them over the chunks (`jaxllm.pooling.PooledState`) until the prompt ends.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxllm.worker.compiler import Compiler
from jaxllm.worker.features import Feature, LaunchedForward, Warmup
from jaxllm.worker.programs import pool_hidden
from jaxllm.worker.step_data import PooledChunk, SchedulerOutput


class HiddenPooler(Feature):
    output = "pooled"

    def __init__(self, compiler: Compiler, max_num_seqs: int, token_buckets: list[int]):
        self.compiler = compiler
        self.max_num_seqs = max_num_seqs
        self.token_buckets = token_buckets
        self._pool = jax.jit(pool_hidden)

    @property
    def num_programs(self) -> int:
        return len(self.token_buckets)

    def warmup_jobs(self, warm: Warmup) -> list:
        """One compile job per token bucket."""

        def compile_pooler(t):
            seqs = np.zeros(self.max_num_seqs, np.int32)
            self.compiler.compile(
                "hidden_pooler", (t,), self._pool, warm.rows(t), np.zeros(t, np.int32), seqs
            )

        return [functools.partial(compile_pooler, t) for t in self.token_buckets]

    def after_forward(self, step: LaunchedForward):
        """Dispatches the pooler over the step's hidden states when a pooling request's chunk
        ran; the device results, or None."""
        out = step.out
        if not any(s.pool for s in out.requests):
            return None
        # out of range: not pooled
        segments = np.full(step.t_pad, self.max_num_seqs, np.int32)
        last_rows = np.zeros(self.max_num_seqs, np.int32)
        start = 0
        for i, s in enumerate(out.requests):
            n = s.num_scheduled_tokens
            if s.pool:
                segments[start : start + n] = i
                last_rows[i] = start + n - 1
            start += n
        return self._pool(step.hidden, segments, last_rows)

    def fetch(self, out: SchedulerOutput, pooling) -> dict[str, PooledChunk]:
        """The pooled chunks of a launched step, by request."""
        if pooling is None:
            return {}
        totals, lasts = jax.device_get(pooling)
        return {
            s.request_id: PooledChunk(totals[i].tolist(), lasts[i].tolist(), s.num_scheduled_tokens)
            for i, s in enumerate(out.requests)
            if s.pool
        }

"""The runner of an encoder (a pooling model): token ids in, one pooled vector per sequence out.

An encoder attends over each sequence whole (bidirectionally), so a sequence runs in one
program and keeps nothing on the device afterwards: no KV cache, no pages. Sequences are padded
into `[B, T]` batches whose shapes come from a fixed set (`make_encoder_buckets`: sequence
lengths and batch sizes in powers of two, at most `max_num_batched_tokens` token slots a batch
unless one sequence needs more), every one compiled at `warmup`; a batch of any other shape is
an error, never a compilation. `run` packs what it is given: longest first, each batch as many
sequences as its shape holds, so lengths that are alike share one.

The default budget is 1,024 token slots a batch: on this project's 2-core CPU, all-MiniLM-L6-v2
embedded 256 sentences at 613 a second in batches of 1,024 slots and at 301 in batches of 8,192
(the larger batch's activations outgrow the caches; `benchmarks/embed_throughput.py`).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.pooling import PoolerConfig, pool
from jaxllm.worker.compiler import CompileCounter

_MIN_TOKENS = 16  # the shortest padded length: shorter ones save nothing worth a program


def _powers_of_two(stop: int, start: int = 1) -> tuple[int, ...]:
    """start, 2 start, 4 start, ... up to `stop`, and `stop` itself."""
    out, n = [], start
    while n < stop:
        out.append(n)
        n *= 2
    return (*out, stop)


@dataclasses.dataclass(frozen=True)
class EncoderBuckets:
    token_buckets: tuple[int, ...]  # padded sequence lengths
    batch_buckets: tuple[int, ...]  # padded sequence counts
    shapes: tuple[tuple[int, int], ...]  # the (B, T) programs

    def largest_batch(self, tokens: int) -> int:
        return max(b for b, t in self.shapes if t == tokens)


def make_encoder_buckets(
    max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int
) -> EncoderBuckets:
    """The shapes an encoder's programs take: every (B, T) of the two ladders with B * T at most
    `max_num_batched_tokens` (and B = 1 at every T, so the longest sequence has one)."""
    for name, value in (
        ("max_model_len", max_model_len),
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    tokens = _powers_of_two(max_model_len, min(_MIN_TOKENS, max_model_len))
    batches = _powers_of_two(max_num_seqs)
    shapes = tuple(
        (b, t) for t in tokens for b in batches if b == 1 or b * t <= max_num_batched_tokens
    )
    return EncoderBuckets(tokens, batches, shapes)


class EncoderRunner:
    """`model` (a `jaxllm.models.bert.BertEncoder`) and its pooling, as bucketed programs."""

    def __init__(
        self,
        model: nnx.Module,
        pooler: PoolerConfig,
        *,
        max_model_len: int,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
    ):
        if max_model_len > model.config.max_len:
            raise ValueError(
                f"max_model_len ({max_model_len}) is longer than the encoder's positions "
                f"({model.config.max_len})"
            )
        self.config = model.config
        self.pooler = pooler
        self.max_model_len = max_model_len
        self.buckets = make_encoder_buckets(max_model_len, max_num_seqs, max_num_batched_tokens)
        self._graphdef, self._state = nnx.split(model)
        self._programs: dict[tuple[int, int], jax.stages.Compiled] = {}
        self.compilations_at_warmup: int | None = None  # set by warmup
        CompileCounter.install()

    @property
    def num_programs(self) -> int:
        return len(self.buckets.shapes)

    @property
    def num_compilations(self) -> int:
        """XLA compilations in this process so far, as `ModelRunner.num_compilations` counts
        them; `compilations_at_warmup` is the count warmup ended at (none may follow)."""
        return CompileCounter.count()

    def _encode(self, state, ids, lengths, type_ids):
        hidden = nnx.merge(self._graphdef, state)(ids, lengths, type_ids)
        return pool(hidden, lengths, self.pooler)

    def warmup(self) -> float:
        """Compiles every program; returns the seconds it took."""
        start = time.perf_counter()
        jitted = jax.jit(self._encode)
        for b, t in self.buckets.shapes:
            ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
            lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
            self._programs[b, t] = jitted.lower(self._state, ids, lengths, ids).compile()
        self.compilations_at_warmup = CompileCounter.count()
        return time.perf_counter() - start

    def pack(self, lengths: list[int]) -> list[tuple[tuple[int, int], list[int]]]:
        """Batches for sequences of `lengths`: ((B, T), the indices it carries), longest first."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        batches = []
        while order:
            tokens = next(t for t in self.buckets.token_buckets if t >= lengths[order[0]])
            count = min(self.buckets.largest_batch(tokens), len(order))
            rows = next(b for b in self.buckets.batch_buckets if b >= count)
            batches.append(((rows, tokens), order[:count]))
            order = order[count:]
        return batches

    def run(
        self, token_ids: list[list[int]], token_type_ids: list[list[int] | None] | None = None
    ) -> np.ndarray:
        """float32 `[len(token_ids), hidden]`: each sequence's pooled vector. `token_type_ids`:
        each sequence's segment ids (a pair's second text is segment 1), or None (all 0)."""
        if self.compilations_at_warmup is None:
            raise RuntimeError("EncoderRunner.run before warmup")
        lengths = [len(ids) for ids in token_ids]
        for i, n in enumerate(lengths):
            if not 1 <= n <= self.max_model_len:
                raise ValueError(
                    f"sequence {i} has {n} tokens: each needs 1 to max_model_len "
                    f"({self.max_model_len})"
                )
        out = np.empty((len(token_ids), self.config.hidden_size), np.float32)
        for (rows, tokens), indices in self.pack(lengths):
            ids = np.full((rows, tokens), self.config.pad_token_id, np.int32)
            types = np.zeros((rows, tokens), np.int32)
            lens = np.ones(rows, np.int32)  # padding rows: one pad token, never read
            for row, i in enumerate(indices):
                ids[row, : lengths[i]] = token_ids[i]
                if token_type_ids is not None and token_type_ids[i] is not None:
                    types[row, : lengths[i]] = token_type_ids[i]
                lens[row] = lengths[i]
            pooled = self._programs[rows, tokens](self._state, ids, lens, types)
            out[indices] = np.asarray(pooled)[: len(indices)]
        return out

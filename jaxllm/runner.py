"""The model runner: SchedulerOutput -> padded device arrays -> one jitted step -> tokens.

The model is split once (`nnx.split`); the hot path is a pure function
`step(state, kv_cache, batch, sampling) -> (sampler output, kv_cache)` under `jax.jit`, with
the cache donated so it is updated in place.

Every batch is padded to a bucket: the token count to the next token bucket, the request count
to the next request bucket, and the block table to a fixed `pages_per_seq` width. The compiled
programs are therefore bounded by `len(token_buckets) * len(request_buckets)` times the sampler
variants (all-greedy or not, logprobs or not). Padding tokens write to an out-of-range slot
(dropped) and padding requests have no tokens and length 0, so they never touch real data.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jaxllm import sharding
from jaxllm.config import ModelConfig
from jaxllm.engine.scheduler import ScheduledRequest, SchedulerOutput
from jaxllm.models import AttentionMetadata
from jaxllm.sampler import SamplingInputs, sample
from jaxllm.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    SAMPLING_EPS,
)
from pallas_kernels import get_kv_cache_shape

logger = logging.getLogger(__name__)


def make_buckets(max_num_batched_tokens: int, max_num_seqs: int) -> tuple[list[int], list[int]]:
    """Token buckets (powers of two from 16) and request buckets (powers of two from 8), each
    list ending at its maximum."""

    def powers(start: int, stop: int) -> list[int]:
        out, b = [], start
        while b < stop:
            out.append(b)
            b *= 2
        return [*out, stop]

    return powers(16, max_num_batched_tokens), powers(8, max_num_seqs)


def compiled_shapes(
    token_buckets: list[int], request_buckets: list[int], max_num_seqs: int
) -> list[tuple[int, int]]:
    """Every (token bucket, request bucket) pair a batch can pad to: a batch of n tokens has at
    most min(n, max_num_seqs) requests, so request buckets past that are never paired."""
    pairs = []
    for t in token_buckets:
        max_reqs = min(t, max_num_seqs)
        prev = 0
        for r in request_buckets:
            if prev < max_reqs:  # some request count in (prev, r] fits this token bucket
                pairs.append((t, r))
            prev = r
    return pairs


# Sampler variants compiled for every shape: (all_greedy, num_logprobs). The fast one serves
# batches where every request is greedy without logprobs, blocked ids, penalties or logit
# bias; the general one everything else (penalties run inside it only when a row has one).
SAMPLER_VARIANTS = ((True, 0), (False, MAX_LOGPROBS))
# Width of the per-request blocked-id array (EOS ids plus stop ids, while min_tokens holds).
MAX_BLOCKED_IDS = MAX_STOP_TOKEN_IDS + 16


def _bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BatchInputs:
    input_ids: jax.Array  # i32[T]  flattened tokens of all scheduled requests
    positions: jax.Array  # i32[T]
    logits_indices: jax.Array  # i32[R]  row of each request's last token
    attn: AttentionMetadata


class _CompileCounter:
    """Counts the XLA programs this process had to produce, through jax.monitoring: backend
    compilations plus executables loaded from the persistent compilation cache (a program
    that was needed either way). Registered once per process."""

    _lock = threading.Lock()
    _count = 0
    _installed = False

    @classmethod
    def _bump(cls) -> None:
        with cls._lock:
            cls._count += 1

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return
            cls._installed = True

        def on_duration(event: str, *args, **kwargs) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                cls._bump()

        def on_event(event: str, *args, **kwargs) -> None:
            if event == "/jax/compilation_cache/cache_hits":
                cls._bump()

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        jax.monitoring.register_event_listener(on_event)

    @classmethod
    def count(cls) -> int:
        return cls._count


class ModelRunner:
    def __init__(
        self,
        model: nnx.Module,
        config: ModelConfig,
        *,
        num_pages: int,
        page_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        dtype: jnp.dtype,
        mesh: Mesh | None = None,
    ):
        """`mesh`: the tensor-parallel mesh the model was loaded onto (the KV cache is split
        over its kv heads the same way); None for one device."""
        _CompileCounter.install()
        self.config = config
        self.page_size = page_size
        self.num_pages = num_pages
        self.pages_per_seq = -(-max_model_len // page_size)
        self.max_model_len = max_model_len  # the width of the penalties' history_ids
        self.token_buckets, self.request_buckets = make_buckets(
            max_num_batched_tokens, max_num_seqs
        )
        self.shapes = compiled_shapes(self.token_buckets, self.request_buckets, max_num_seqs)
        self.graphdef, self.state = nnx.split(model)
        shape = get_kv_cache_shape(
            config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim
        )
        self.mesh = mesh
        self.kv_cache = self._zeros_cache(shape, dtype)
        self.kv_cache_lost = False  # set when a failed step took the cache with it
        self._idle_penalty_inputs: dict[int, dict[str, jax.Array]] = {}  # by request bucket
        self._step = jax.jit(
            functools.partial(_step, self.graphdef, mesh),
            donate_argnums=(1,),
            static_argnames=("all_greedy", "num_logprobs"),
        )
        self._score = jax.jit(functools.partial(_score_prompt, self.graphdef))

    @property
    def num_compilations(self) -> int:
        """XLA compilations in this process so far (all runners and helpers included)."""
        return _CompileCounter.count()

    @property
    def num_programs(self) -> int:
        """The bound on compiled programs: shapes times sampler variants, plus one prompt
        scorer (prompt_logprobs) per token bucket."""
        return len(self.shapes) * len(SAMPLER_VARIANTS) + len(self.token_buckets)

    def warmup(self, *, progress: bool = True) -> float:
        """Compiles (or loads from the persistent cache) every program a batch can need, so
        nothing compiles while serving. Returns the seconds it took."""
        start = time.perf_counter()
        jobs = [(t, r, v) for t, r in self.shapes for v in SAMPLER_VARIANTS]
        for t, r, (all_greedy, num_logprobs) in tqdm(
            jobs, desc="Compiling buckets", disable=not progress, unit="program"
        ):
            batch, sampling = self._padding_batch(t, r)
            # Ahead-of-time: compile (or load from the persistent cache) without running.
            # The jitted function reuses these executables when a real batch arrives.
            self._step.lower(
                self.state,
                self.kv_cache,
                batch,
                sampling,
                all_greedy=all_greedy,
                num_logprobs=num_logprobs,
            ).compile()
        # The prompt scorer, per token bucket, on hidden states shaped as the step makes them.
        _, hidden, _ = jax.eval_shape(
            functools.partial(self._step, all_greedy=True, num_logprobs=0),
            self.state,
            self.kv_cache,
            *self._padding_batch(*self.shapes[0]),
        )
        for t in self.token_buckets:
            hidden_t = jax.ShapeDtypeStruct(
                (t, *hidden.shape[1:]),
                hidden.dtype,
                sharding=None if self.mesh is None else sharding.replicated(self.mesh),
            )
            self._score.lower(self.state, hidden_t, np.zeros(t, np.int32)).compile()
        return time.perf_counter() - start

    def _padding_batch(self, t_pad: int, r_pad: int) -> tuple[BatchInputs, SamplingInputs]:
        """Fresh arrays of the given padded shape holding no request: such a batch writes
        nothing. The one place padding values are defined (those of logit bias and penalties in
        `_penalty_padding`); `prepare` fills requests in."""

        def ints(*shape: int, fill: int = 0) -> np.ndarray:
            return np.full(shape, fill, np.int32)

        batch = BatchInputs(
            input_ids=ints(t_pad),
            positions=ints(t_pad),
            logits_indices=ints(r_pad),
            attn=AttentionMetadata(
                slot_mapping=ints(t_pad, fill=self.num_pages * self.page_size),  # dropped
                seq_lens=ints(r_pad),
                block_tables=ints(r_pad, self.pages_per_seq),
                cu_q_lens=ints(r_pad + 1),
                num_seqs=ints(1),
            ),
        )
        sampling = SamplingInputs(
            temperature=np.zeros(r_pad, np.float32),
            top_k=ints(r_pad),
            top_p=np.ones(r_pad, np.float32),
            min_p=np.zeros(r_pad, np.float32),
            seeds=np.zeros((r_pad, 2), np.uint32),
            counters=ints(r_pad),
            blocked_ids=ints(r_pad, MAX_BLOCKED_IDS, fill=self.config.vocab_size),  # dropped
            **self._penalty_inputs(r_pad),
        )
        return batch, sampling

    def _penalty_padding(self, r_pad: int) -> dict[str, np.ndarray]:
        """Logit-bias and penalty arrays holding no bias and no penalty."""
        vocab = self.config.vocab_size
        return {
            "logit_bias_ids": np.full((r_pad, MAX_LOGIT_BIAS), vocab, np.int32),  # dropped
            "logit_bias": np.zeros((r_pad, MAX_LOGIT_BIAS), np.float32),
            "presence_penalty": np.zeros(r_pad, np.float32),
            "frequency_penalty": np.zeros(r_pad, np.float32),
            "repetition_penalty": np.ones(r_pad, np.float32),
            "history_ids": np.full((r_pad, self.max_model_len), vocab, np.int32),  # dropped
            "num_prompt_tokens": np.zeros(r_pad, np.int32),
        }

    def _penalty_inputs(self, r_pad: int) -> dict[str, jax.Array]:
        """The padding of `_penalty_padding`, kept on the device once per request bucket: a
        batch without bias or penalties neither builds nor sends the [R, max_model_len]
        history (`prepare` swaps in host arrays when some request needs them)."""
        if r_pad not in self._idle_penalty_inputs:
            target = None if self.mesh is None else sharding.replicated(self.mesh)
            self._idle_penalty_inputs[r_pad] = jax.device_put(self._penalty_padding(r_pad), target)
        return self._idle_penalty_inputs[r_pad]

    def _fill_penalty_inputs(
        self, sampling: SamplingInputs, reqs: list[ScheduledRequest]
    ) -> SamplingInputs:
        """Host arrays for logit bias and penalties, filled for the requests that sample with
        them; `sampling` unchanged (the device-resident padding) when none does."""
        biased = any(r.sample and r.logit_bias for r in reqs)
        penalized = any(r.history_ids is not None for r in reqs)
        if not (biased or penalized):
            return sampling
        host = self._penalty_padding(len(sampling.temperature))
        if not penalized:
            host = {k: v for k, v in host.items() if k.startswith("logit_bias")}
        for i, r in enumerate(reqs):
            if not r.sample:
                continue
            if biased and r.logit_bias:
                host["logit_bias_ids"][i, : len(r.logit_bias)] = list(r.logit_bias)
                host["logit_bias"][i, : len(r.logit_bias)] = list(r.logit_bias.values())
            if r.history_ids is not None:
                host["presence_penalty"][i] = r.presence_penalty
                host["frequency_penalty"][i] = r.frequency_penalty
                host["repetition_penalty"][i] = r.repetition_penalty
                host["history_ids"][i, : len(r.history_ids)] = r.history_ids
                host["num_prompt_tokens"][i] = r.num_prompt_tokens
        if self.mesh is not None:  # placed like the device-resident padding warmup saw
            host = jax.device_put(host, sharding.replicated(self.mesh))
        return dataclasses.replace(sampling, **host)

    def _zeros_cache(self, shape, dtype) -> jax.Array:
        """A zero cache, created in place on its devices (split on kv heads under a mesh)."""
        if self.mesh is None:
            return jnp.zeros(shape, dtype)
        out = sharding.kv_cache_sharding(self.mesh)
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=out)()

    def kv_cache_bytes(self) -> int:
        return self.kv_cache.size * self.kv_cache.dtype.itemsize

    def prepare(self, out: SchedulerOutput) -> tuple[BatchInputs, SamplingInputs, dict]:
        reqs = out.requests
        num_reqs = len(reqs)
        num_tokens = out.total_num_scheduled_tokens
        t_pad = _bucket(num_tokens, self.token_buckets)
        r_pad = _bucket(num_reqs, self.request_buckets)
        batch, sampling = self._padding_batch(t_pad, r_pad)
        attn = batch.attn
        attn.num_seqs[0] = num_reqs
        attn.cu_q_lens[:] = num_tokens  # padding requests: empty, after the last real token

        start = 0
        for i, r in enumerate(reqs):
            n = len(r.token_ids)
            pos = np.arange(r.num_computed_tokens, r.num_computed_tokens + n, dtype=np.int32)
            blocks = np.asarray(r.block_ids, np.int32)
            batch.input_ids[start : start + n] = r.token_ids
            batch.positions[start : start + n] = pos
            attn.slot_mapping[start : start + n] = (
                blocks[pos // self.page_size] * self.page_size + pos % self.page_size
            )
            attn.cu_q_lens[i] = start
            attn.seq_lens[i] = r.num_computed_tokens + n
            attn.block_tables[i, : len(blocks)] = blocks
            batch.logits_indices[i] = start + n - 1
            sampling.temperature[i] = r.temperature
            sampling.top_k[i] = r.top_k
            sampling.top_p[i] = r.top_p
            sampling.min_p[i] = r.min_p
            seed = r.seed % 2**64
            sampling.seeds[i] = (seed & 0xFFFFFFFF, seed >> 32)
            sampling.counters[i] = r.num_output_tokens
            ids = r.blocked_token_ids[:MAX_BLOCKED_IDS]
            sampling.blocked_ids[i, : len(ids)] = ids
            start += n
        sampling = self._fill_penalty_inputs(sampling, reqs)

        sampling_reqs = [r for r in reqs if r.sample]
        fast = all(
            r.temperature < SAMPLING_EPS
            and r.num_logprobs is None
            and not r.blocked_token_ids
            and not r.logit_bias
            and r.history_ids is None
            for r in sampling_reqs
        )
        all_greedy, num_logprobs = SAMPLER_VARIANTS[0 if fast else 1]
        return batch, sampling, {"all_greedy": all_greedy, "num_logprobs": num_logprobs}

    def execute(
        self, out: SchedulerOutput
    ) -> tuple[dict[str, tuple[int, tuple | None]], dict[str, list]]:
        """Runs one step. Returns {request_id: (token, logprobs or None)} for every request
        whose scheduled chunk reached the end of its sequence, and {request_id: [(prompt
        token, logprob, rank, top ids, top logprobs), ...]} for the prompt tokens the chunk
        scored (prompt_logprobs)."""
        batch, sampling, variant = self.prepare(out)
        try:
            result, hidden, self.kv_cache = self._step(
                self.state, self.kv_cache, batch, sampling, **variant
            )
            result = jax.device_get(result)
            prompt_logprobs = self._score_prompts(out, hidden, len(batch.input_ids))
        except BaseException:
            # The cache was donated to the failed step: if it is gone, start from a fresh one
            # so the engine can serve again (the caller drops every cached prefix).
            if self.kv_cache.is_deleted():
                self.kv_cache = self._zeros_cache(self.kv_cache.shape, self.kv_cache.dtype)
                self.kv_cache_lost = True
            raise
        sampled = {}
        for i, r in enumerate(out.requests):
            if not r.sample:
                continue
            logprobs = None
            if r.num_logprobs is not None:
                k = r.num_logprobs
                logprobs = (
                    float(result.logprob[i]),
                    int(result.rank[i]),
                    result.top_ids[i, :k].tolist(),
                    result.top_logprobs[i, :k].tolist(),
                )
            sampled[r.request_id] = (int(result.sampled[i]), logprobs)
        return sampled, prompt_logprobs

    def _score_prompts(self, out: SchedulerOutput, hidden: jax.Array, t_pad: int):
        """Logprobs of the prompt tokens the step's chunks scored, from its hidden states."""
        if not any(r.prompt_logprob_targets for r in out.requests):
            return {}
        targets = np.full(t_pad, -1, np.int32)
        start = 0
        for r in out.requests:
            if r.prompt_logprob_targets:
                targets[start : start + len(r.token_ids)] = r.prompt_logprob_targets
            start += len(r.token_ids)
        logprob, rank, top_ids, top_lps = jax.device_get(self._score(self.state, hidden, targets))
        scored, start = {}, 0
        for r in out.requests:
            n = len(r.token_ids)
            if r.prompt_logprob_targets:
                k = r.num_prompt_logprobs
                scored[r.request_id] = [
                    (
                        int(targets[t]),
                        float(logprob[t]),
                        int(rank[t]),
                        top_ids[t, :k].tolist(),
                        top_lps[t, :k].tolist(),
                    )  # fmt: skip
                    for t in range(start, start + n)
                    if targets[t] >= 0
                ]
            start += n
        return scored


def _step(
    graphdef,
    mesh,
    state,
    kv_cache,
    batch: BatchInputs,
    sampling: SamplingInputs,
    *,
    all_greedy: bool,
    num_logprobs: int,
):
    model = nnx.merge(graphdef, state)
    hidden, kv_cache = model(batch.input_ids, batch.positions, kv_cache, batch.attn)
    logits = model.compute_logits(hidden[batch.logits_indices])
    if mesh is not None:  # split on the vocabulary by the head: gather it for the sampler
        logits = jax.lax.with_sharding_constraint(logits, sharding.replicated(mesh))
        hidden = jax.lax.with_sharding_constraint(hidden, sharding.replicated(mesh))
    result = sample(logits, sampling, all_greedy=all_greedy, num_logprobs=num_logprobs)
    return result, hidden, kv_cache


def _score_prompt(graphdef, state, hidden: jax.Array, targets: jax.Array):
    """prompt_logprobs: for each token row, the logprob and rank of `targets` (the next prompt
    token; -1 rows are ignored) and the top MAX_LOGPROBS, from the raw logits."""
    model = nnx.merge(graphdef, state)
    logprobs = jax.nn.log_softmax(model.compute_logits(hidden), axis=-1)  # [T, V]
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]
    rank = (logprobs > chosen[:, None]).sum(axis=-1).astype(jnp.int32) + 1
    top_lps, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    return chosen, rank, top_ids.astype(jnp.int32), top_lps

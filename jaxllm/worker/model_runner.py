"""The model runner: SchedulerOutput -> padded device arrays -> two jitted programs -> tokens.

The requests in the batch live in a persistent `InputBatch` (one row of host arrays each),
updated from each step's diffs; `prepare` gathers a step's inputs from its rows.

The model is split once (`nnx.split`) and its parameters kept as a flat list of arrays. A step
runs two pure functions under `jax.jit`: `_forward(params, kv_cache, batch) -> (hidden states
to sample from, all hidden states, kv_cache)`, with the cache donated so it is updated in
place, and `_head_and_sample(params, hidden, sampling) -> sampler output`.

Every batch is padded to a compiled shape (`make_buckets`): the token count to a token bucket,
the request count to a request bucket paired with it, and the block table to a fixed
`pages_per_seq` width. One forward program per shape and one head-and-sampler program per
request bucket (the sampler's optional work is data-dependent inside it, see `sampler.py`), all
compiled at warmup. Padding tokens write to an out-of-range slot (dropped) and padding requests
have no tokens and length 0, so they never touch real data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

import pallas_kernels
from jaxllm import sharding
from jaxllm.config import ModelConfig, SpecMethod
from jaxllm.engine.step_data import (
    PromptTokenLogprobs,
    RunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from jaxllm.input_batch import MAX_BLOCKED_IDS, InputBatch
from jaxllm.models import AttentionMetadata
from jaxllm.sampler import SamplingInputs, sample, token_logprobs
from jaxllm.sampling_params import MAX_LOGIT_BIAS
from jaxllm.spec_decode import NgramProposer
from pallas_kernels import KVCache, get_kv_cache_shape, is_quantized_dtype, zeros_kv_cache
from pallas_kernels.kv_cache import abstract_kv_cache, as_kv_cache

logger = logging.getLogger(__name__)


def _ladder(stop: int) -> list[int]:
    """Bucket sizes 1, 4, 16, then doubling, below `stop`, then `stop`.

    Steps of 4 at the small end: XLA's CPU matmuls take about as long for 2 to 16 rows as for
    16 (1.2-1.6 ms per layer of the demo model on a 2-core AMD EPYC, against 0.5-0.65 ms for
    one row), and on accelerators a weight-streaming matmul costs the same for any row count
    that small; so buckets of 2 and 8 would only add programs to compile. Past 16 the work
    grows with the rows, and doubling keeps padding under 2x."""
    out, b = [], 1
    while b < stop:
        out.append(b)
        b = b * 4 if b < 16 else b * 2
    return [*out, stop]


# A token bucket t pairs with the request buckets r in [limit / _REQUEST_SPAN, limit], limit =
# min(t, max_num_seqs). Fewer requests than that in t tokens means a prefill chunk is in the
# batch, and its token work dwarfs what the padded request rows cost (the output head and the
# sampler run per request row: on the demo model on a 2-core CPU, 4 ms for one row, 11 ms for 8,
# 30 ms for 64, against ~700 ms for a 512-token step).
_REQUEST_SPAN = 4


def make_buckets(
    max_num_batched_tokens: int, max_num_seqs: int, num_speculative_tokens: int = 0
) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """(token buckets, request buckets, compiled shapes): both bucket lists follow `_ladder` up
    to their maximum, so a one-request decode is a (1, 1) program (no 16-token, 8-row floor);
    the shapes are the (token bucket, request bucket) pairs a batch can pad to, at most three
    request buckets per token bucket (see `_REQUEST_SPAN`). With speculative decoding of k
    tokens, r requests verifying k drafts each fill a token bucket of r * (1 + k)."""
    tokens, requests = _ladder(max_num_batched_tokens), _ladder(max_num_seqs)
    if num_speculative_tokens:
        spec = (r * (1 + num_speculative_tokens) for r in requests)
        tokens = sorted({*tokens, *(t for t in spec if t < max_num_batched_tokens)})
    shapes = []
    for t in tokens:
        limit = min(t, max_num_seqs)
        shapes += [(t, r) for r in requests if r <= limit and r * _REQUEST_SPAN >= limit]
    return tokens, requests, shapes


def logit_rows(shape: tuple[int, int], num_speculative_tokens: int) -> int:
    """Rows of hidden states a step of this shape samples from: one per request, and with
    speculative decoding one more per draft token (never more than its tokens)."""
    t, r = shape
    return min(t, r * (1 + num_speculative_tokens))


def pick_shape(num_tokens: int, num_reqs: int, shapes: list[tuple[int, int]]) -> tuple[int, int]:
    """The smallest compiled shape that holds the batch: the least token bucket, then the least
    request bucket paired with it."""
    for t, r in shapes:  # ordered by token bucket, then request bucket
        if t >= num_tokens and r >= num_reqs:
            return t, r
    raise ValueError(f"no compiled shape holds {num_tokens} tokens of {num_reqs} requests")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BatchInputs:
    input_ids: jax.Array  # i32[T]  flattened tokens of all scheduled requests (drafts included)
    # i32[T]  -1, or the batch row whose token sampled by the previous step (still on the
    # device, see `ModelRunner.last_tokens`) is this input: async scheduling's decode inputs
    token_src: jax.Array
    positions: jax.Array  # i32[T]
    # i32[L]  the tokens to sample after: each request's last token (with speculative decoding,
    # also its draft tokens: L = `logit_rows`)
    logits_indices: jax.Array
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
        dtype: jnp.dtype,  # the KV cache's
        mesh: Mesh | None = None,
        speculative: SpecMethod | None = None,
        draft_model: tuple[nnx.Module, ModelConfig] | None = None,
    ):
        """`mesh`: the tensor-parallel mesh the model was loaded onto (the KV cache is split
        over its kv heads the same way); None for one device. `speculative`: how draft tokens
        are proposed (see `jaxllm.spec_decode`), with `draft_model` (loaded onto the same
        mesh) for the draft_model method."""
        _CompileCounter.install()
        self.num_speculative_tokens = k = speculative.num_speculative_tokens if speculative else 0
        self.proposer = None
        if speculative is not None and speculative.method == "ngram":
            self.proposer = NgramProposer(
                k, speculative.prompt_lookup_min, speculative.prompt_lookup_max
            )
        self.config = config
        self.page_size = page_size
        self.num_pages = num_pages
        self.pages_per_seq = -(-max_model_len // page_size)
        self.max_model_len = max_model_len  # the width of the penalties' history_ids
        self.token_buckets, self.request_buckets, self.shapes = make_buckets(
            max_num_batched_tokens, max_num_seqs, k
        )
        # The head-and-sampler programs, by rows sampled (`logit_rows` of each shape).
        self.logit_buckets = sorted({logit_rows(shape, k) for shape in self.shapes})
        # The parameters travel as a flat list of arrays: a call flattens a list in C++, while
        # an nnx.State flattens through Python per variable (about 1 ms a step on the demo model).
        self.graphdef, state = nnx.split(model)
        self._params, self._params_def = jax.tree.flatten(state)
        shape = get_kv_cache_shape(
            config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim
        )
        self.mesh = mesh
        # A runner over abstract parameters (`jax.ShapeDtypeStruct`s placed on the devices of
        # a target that may not be here, see `jaxllm.aot`) compiles every program and runs none.
        self.abstract = isinstance(self._params[0], jax.ShapeDtypeStruct)
        # Where host inputs go: the default device (the target's, for an abstract runner), or
        # replicated over the mesh.
        self._replicated = None if mesh is None else sharding.replicated(mesh)
        if self.abstract and mesh is None:
            self._replicated = self._params[0].sharding
        self.kv_cache = self._zeros_cache(shape, dtype)
        self.kv_cache_lost = False  # set when a failed step took the cache with it
        self.input_batch = InputBatch(
            max_num_seqs, max_model_len, self.pages_per_seq, config.vocab_size
        )
        # The token each batch row sampled last, kept on the device: the next step's decode
        # input for that row when it was scheduled before this step's output came back.
        self.max_num_seqs = max_num_seqs
        self.last_tokens = self._zeros_last_tokens()
        # Every program `warmup` compiled, with what its compiler says of it; and with
        # `keep_executables` set, the executables themselves (`jaxllm compile
        # --save-executables` serializes them).
        self.programs: list[CompiledProgram] = []
        self.keep_executables = False
        self.executables: dict[tuple[str, tuple], Any] = {}
        self._idle_device_inputs: dict[int, dict[str, jax.Array]] = {}  # by logit bucket
        self.bitmask_words = -(-config.vocab_size // 32)  # int32 words per grammar bitmask row
        # Counters since start, for metrics: the tokens the steps computed, the token slots of
        # the compiled shapes they ran (the difference is padding), and the seconds `fetch`
        # waited for the device.
        self.num_scheduled_tokens = 0
        self.num_padded_tokens = 0
        self.device_wait_seconds = 0.0
        # Two programs per step: the forward pass per (token, request) shape, and the output
        # head with the sampler per request bucket only (the sampler compiles about as long as
        # the 30 layers of the demo model; compiled into every shape it doubled startup).
        self._forward = jax.jit(
            functools.partial(_forward, self.graphdef, self._params_def, mesh), donate_argnums=(1,)
        )
        # `last_tokens` is not donated (a few KiB): donating a buffer the forward pass still
        # reads made the host wait for that pass before it could dispatch the sampler.
        self._sample = jax.jit(
            functools.partial(_head_and_sample, self.graphdef, self._params_def, mesh)
        )
        self._score = jax.jit(functools.partial(_score_prompt, self.graphdef, self._params_def))
        self.drafter = None
        if speculative is not None and speculative.method == "draft_model":
            from jaxllm.draft_runner import DraftRunner

            if draft_model is None:
                raise ValueError("speculative_config: the draft_model method needs the draft")
            self.drafter = DraftRunner(*draft_model, runner=self)

    @property
    def state(self) -> nnx.State:
        """The model's parameters (`nnx.merge(runner.graphdef, runner.state)` rebuilds it)."""
        return jax.tree.unflatten(self._params_def, self._params)

    @property
    def num_compilations(self) -> int:
        """XLA compilations in this process so far (all runners and helpers included)."""
        return _CompileCounter.count()

    @property
    def num_programs(self) -> int:
        """The bound on compiled programs: a forward pass per shape, the head and sampler per
        logit bucket (the request buckets, without speculative decoding), and one prompt
        scorer (prompt_logprobs) per token bucket."""
        drafts = len(self.shapes) if self.drafter is not None else 0  # see `DraftRunner`
        return len(self.shapes) + len(self.logit_buckets) + len(self.token_buckets) + drafts

    def warmup(
        self, *, progress: bool = True, check_in_place: bool = True, decode_only: bool = False
    ) -> float:
        """Compiles (or loads from the persistent cache) every program a batch can need, so
        nothing compiles while serving. Returns the seconds it took. XLA compiles without the
        GIL, so the programs compile on one thread per CPU core. Raises if a program would copy
        the KV cache instead of updating it in place (see `updates_in_place`), unless
        `check_in_place` is off (`jaxllm compile` reports them instead). `decode_only`: only
        the programs of decode steps (as many tokens as requests), for a quick look at a target
        (`jaxllm compile --programs decode`); an engine that serves needs them all."""
        start = time.perf_counter()
        # Traced for the target as the programs are: jit caches this trace, and a program
        # compiled later for the same inputs reuses it (with the host's kernels, were it not).
        with self._traced_for_target():
            _, hidden, _ = jax.eval_shape(
                self._forward,
                self._params,
                self.kv_cache,
                self.last_tokens,
                self._padding_batch(*self.shapes[0]),
            )

        def rows(n: int) -> jax.ShapeDtypeStruct:  # hidden states shaped as the forward makes them
            return jax.ShapeDtypeStruct(
                (n, *hidden.shape[1:]), hidden.dtype, sharding=self._replicated
            )

        # Ahead-of-time: compile (or load) without running. The jitted functions reuse these
        # executables when real batches arrive.
        def forward(shape):
            batch = self._padding_batch(*shape)
            args = (self._params, self.kv_cache, self.last_tokens, batch)
            self.compile_program("forward", shape, self._forward, *args, updates_cache=True)

        def head(n):
            sampling, verify = self._padding_sampling(n)
            args = (self._params, rows(n), sampling, verify, self.last_tokens)
            self.compile_program("head_and_sample", (n,), self._sample, *args)

        def scorer(t):
            args = (self._params, rows(t), np.zeros(t, np.int32))
            self.compile_program("prompt_scorer", (t,), self._score, *args)

        shapes = [s for s in self.shapes if not decode_only or s[0] == s[1]]
        jobs = [functools.partial(forward, shape) for shape in shapes]
        logit_buckets = sorted({logit_rows(s, self.num_speculative_tokens) for s in shapes})
        jobs += [functools.partial(head, n) for n in logit_buckets]
        if not decode_only:
            jobs += [functools.partial(scorer, t) for t in self.token_buckets]
            if self.drafter is not None:
                jobs += self.drafter.warmup_jobs()
        # Several processes (multi-host) compile one at a time: compiling a program that spans
        # them exchanges messages between them, which must come in the same order on each.
        # libtpu compiling two programs at once for compile-only devices (`jaxllm compile`)
        # crashes the process (SIGSEGV, measured with jax 0.10.2 / libtpu 0.0.42.1).
        serial = jax.process_count() > 1 or (self.abstract and self._platform == "tpu")
        workers = 1 if serial else max(1, min(os.cpu_count() or 1, 8))
        with (
            ThreadPoolExecutor(workers) as pool,
            tqdm(total=len(jobs), desc="Compiling", disable=not progress, unit="program") as bar,
        ):
            for future in [pool.submit(job) for job in jobs]:
                future.result()
                bar.update(1)
        copies = self.cache_copies()
        if copies and check_in_place:
            raise RuntimeError(
                f"{len(copies)} step program(s) would copy the KV cache "
                f"({self.kv_cache.nbytes / 2**20:.0f} MiB) instead of updating it in place "
                f"(slow steps, and twice the cache's memory): "
                + ", ".join(f"{p.name} {p.shape}: {p.describe()}" for p in copies)
            )
        # A copy of an 8-bit cache's scales (a 16th to a 32nd of the data) costs bandwidth, not
        # twice the memory: XLA makes one in some steps, an open defect (issue 33), so it is
        # named here rather than refused.
        if scales := [p for p in self.programs if p.scales_copy_ops]:
            logger.warning(
                "%d step program(s) copy the KV cache's scales: %s",
                len(scales),
                ", ".join(f"{p.name} {p.shape}" for p in scales),
            )
        return time.perf_counter() - start

    def compile_program(
        self, name: str, shape: tuple, fn, *args, updates_cache: bool = False, cache=None
    ) -> CompiledProgram:
        """Compiles `fn(*args)` (a jitted function) and records it in `programs`. An abstract
        runner compiles for its parameters' devices with their platform's compiler (a TPU's or
        a GPU's, on this machine), with the kernels traced for that platform."""
        start = time.perf_counter()
        if not self.abstract:
            compiled = fn.lower(*args).compile()
        else:
            device = next(iter(self._replicated.device_set))
            args = jax.tree.map(self._abstract_input, args)
            with self._traced_for_target():
                traced = fn.trace(*args)
                platforms = (pallas_kernels.lowering_platform(device),)
                compiled = traced.lower(lowering_platforms=platforms).compile()
        program = CompiledProgram.of(
            name, shape, compiled, time.perf_counter() - start, updates_cache=updates_cache
        )
        if updates_cache:
            cache = self.kv_cache if cache is None else cache  # the draft model's has its own
            program = dataclasses.replace(
                program,
                cache_bytes=sum(
                    int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                    for x in jax.tree.leaves(cache)
                ),
                cache_copy_ops=self._cache_copy_ops(compiled, cache),
                scales_copy_ops=self._cache_copy_ops(compiled, cache, "scales"),
            )
        with _PROGRAMS_LOCK:
            self.programs.append(program)
            if self.keep_executables:
                self.executables[name, tuple(shape)] = compiled
        return program

    @property
    def _platform(self) -> str:
        """The platform of the runner's devices (a compile-only target's for an abstract one)."""
        return next(iter(self._replicated.device_set)).platform

    def _traced_for_target(self) -> contextlib.AbstractContextManager:
        """For an abstract runner, kernels traced for its devices' platform (see
        `pallas_kernels.target_platform`); nothing to change otherwise."""
        if not self.abstract:
            return contextlib.nullcontext()
        device = next(iter(self._replicated.device_set))
        return pallas_kernels.target_platform(device.platform, device)

    def _abstract_input(self, x):
        """A host input of an abstract runner's program, as an abstract value on its devices."""
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        x = np.asarray(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._replicated)

    def cache_copies(self) -> list[CompiledProgram]:
        """The compiled programs that take the KV cache and would copy it."""
        return [p for p in self.programs if p.updates_cache and not self.updates_in_place(p)]

    @property
    def kv_cache_device_bytes(self) -> int:
        """The KV cache's logical bytes on one device (all of it without a mesh)."""
        nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self.kv_cache))
        return nbytes // (1 if self.mesh is None else self.mesh.shape["model"])

    def updates_in_place(self, program: CompiledProgram) -> bool:
        """Whether a step program writes the donated KV cache in place, from what its compiler
        says: its output aliases the cache, and no instruction of the compiled program makes a
        new array of the cache's shape (see `cache_copy_ops`)."""
        return program.alias_bytes >= program.cache_bytes and not program.cache_copy_ops

    def _cache_copy_ops(self, compiled, cache, array: str = "data") -> tuple[str, ...]:
        """The instructions of a compiled step program that copy the KV cache's `array` ("data",
        or the 8-bit cache's "scales"). XLA has copied the data when a one-token write became a
        dynamic-update-slice (see `write_kv`), when it widened a float8 cache for the scatter,
        and when the TPU kernel wanted another tiling of the cache than the one it was given. A
        copy needs temporaries of the array's size, so only a program that has that many is
        read (the temporaries alone would also count a small cache's neighbours: an MoE layer's
        transposed expert weights outweigh a 64-page one)."""
        x = getattr(as_kv_cache(cache), array)
        if x is None:
            return ()
        shape = x.sharding.shard_shape(x.shape)
        if compiled.memory_analysis().temp_size_in_bytes < np.prod(shape) * x.dtype.itemsize:
            return ()
        return cache_copy_ops(compiled.as_text(), [shape])

    def _padding_batch(self, t_pad: int, r_pad: int) -> BatchInputs:
        """Fresh arrays of the given padded shape holding no request: such a batch writes
        nothing. With `_padding_sampling`, the one place padding values are defined (those of
        logit bias and penalties in `_penalty_padding`); `prepare` fills requests in."""
        num_logits = logit_rows((t_pad, r_pad), self.num_speculative_tokens)
        return BatchInputs(
            input_ids=_ints(t_pad),
            token_src=_ints(t_pad, fill=-1),
            positions=_ints(t_pad),
            logits_indices=_ints(num_logits),
            attn=AttentionMetadata(
                slot_mapping=_ints(t_pad, fill=self.num_pages * self.page_size),  # dropped
                seq_lens=_ints(r_pad),
                block_tables=_ints(r_pad, self.pages_per_seq),
                cu_q_lens=_ints(r_pad + 1),
                num_seqs=_ints(1),
            ),
        )

    def _padding_sampling(self, n: int) -> tuple[SamplingInputs, VerifyInputs]:
        """Sampler and verification inputs for `n` rows that sample nothing anyone reads."""
        sampling = SamplingInputs(
            temperature=np.zeros(n, np.float32),
            top_k=_ints(n),
            top_p=np.ones(n, np.float32),
            min_p=np.zeros(n, np.float32),
            seeds=np.zeros((n, 2), np.uint32),
            counters=_ints(n),
            logprobs=np.zeros(n, np.bool_),
            blocked_ids=_ints(n, MAX_BLOCKED_IDS, fill=self.config.vocab_size),  # dropped
            **self._idle_inputs(n),
        )
        verify = VerifyInputs(
            sample_rows=_ints(n, fill=self.max_num_seqs),  # dropped
            drafts=_ints(n, fill=-1),
            first_rows=np.arange(n, dtype=np.int32),
        )
        return sampling, verify

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

    def _idle_inputs(self, r_pad: int) -> dict[str, jax.Array]:
        """The padding of `_penalty_padding` and an all-allowing grammar bitmask, kept on the
        device once per logit bucket: a batch without bias, penalties or grammars neither
        builds nor sends the [R, max_model_len] history or the [R, V / 32] bitmask (`prepare`
        swaps in host arrays when some request needs them)."""
        if r_pad not in self._idle_device_inputs:
            padding = self._penalty_padding(r_pad)
            padding["token_bitmask"] = _ints(r_pad, self.bitmask_words, fill=-1)
            self._idle_device_inputs[r_pad] = self._put(padding)
        return self._idle_device_inputs[r_pad]

    def _fill_bitmask(
        self, sampling: SamplingInputs, out: SchedulerOutput, first_row: np.ndarray
    ) -> SamplingInputs:
        """Structured outputs: the step's bitmask rows at their requests' logit rows."""
        mask = out.grammar_bitmask
        if mask is None:
            return sampling
        rows = np.frombuffer(mask.data, np.int32).reshape(-1, self.bitmask_words)
        index = {s.request_id: i for i, s in enumerate(out.requests)}
        host = _ints(len(sampling.temperature), self.bitmask_words, fill=-1)
        start = 0
        for rid in mask.request_ids:
            i = index[rid]
            n = 1 + len(out.requests[i].spec_token_ids)
            host[first_row[i] : first_row[i] + n] = rows[start : start + n]
            start += n
        token_bitmask = host if self.mesh is None else jax.device_put(host, self._replicated)
        return dataclasses.replace(sampling, token_bitmask=token_bitmask)

    def _fill_penalty_inputs(
        self, sampling: SamplingInputs, rows: np.ndarray, samples: np.ndarray, lens: np.ndarray
    ) -> SamplingInputs:
        """Host arrays for logit bias and penalties, filled from the rows that sample with
        them (batch rows `rows`, each sampling after its first `lens` tokens); `sampling`
        unchanged (the device-resident padding) when none does."""
        ib = self.input_batch
        biased = ib.has_logit_bias[rows] & samples
        penalized = ib.uses_penalties[rows] & samples
        if not (biased.any() or penalized.any()):
            return sampling
        host = self._penalty_padding(len(sampling.temperature))
        if not penalized.any():
            host = {k: v for k, v in host.items() if k.startswith("logit_bias")}
        n = len(rows)
        if biased.any():
            host["logit_bias_ids"][:n] = np.where(
                biased[:, None], ib.logit_bias_ids[rows], self.config.vocab_size
            )
            host["logit_bias"][:n] = np.where(biased[:, None], ib.logit_bias[rows], 0.0)
        if penalized.any():
            host["presence_penalty"][:n] = np.where(penalized, ib.presence_penalty[rows], 0.0)
            host["frequency_penalty"][:n] = np.where(penalized, ib.frequency_penalty[rows], 0.0)
            host["repetition_penalty"][:n] = np.where(penalized, ib.repetition_penalty[rows], 1.0)
            seen = np.arange(ib.token_ids.shape[1])[None, :] < lens[:, None]
            host["history_ids"][:n] = np.where(seen, ib.token_ids[rows], self.config.vocab_size)
            host["num_prompt_tokens"][:n] = ib.num_prompt_tokens[rows]
        if self.mesh is not None:  # placed like the device-resident padding warmup saw
            host = jax.device_put(host, self._replicated)
        return dataclasses.replace(sampling, **host)

    def _zeros_last_tokens(self) -> jax.Array:
        return self._put(np.zeros(self.max_num_seqs, np.int32))

    def _put(self, host):
        """Host arrays (a pytree) placed where host inputs go (abstract values for an abstract
        runner)."""
        if self.abstract:
            return jax.tree.map(self._abstract_input, host)
        return jax.device_put(host, self._replicated)

    def _zeros_cache(self, shape, dtype) -> KVCache:
        """A zero cache, created in place on its devices (split on kv heads under a mesh); an
        abstract runner's is abstract."""
        if self.mesh is None:
            if self.abstract:
                return abstract_kv_cache(shape, dtype, (self._replicated,) * 2)
            return zeros_kv_cache(shape, dtype)
        out = sharding.kv_cache_sharding(self.mesh, is_quantized_dtype(dtype))
        if self.abstract:
            return abstract_kv_cache(shape, dtype, out)
        return jax.jit(lambda: zeros_kv_cache(shape, dtype), out_shardings=out)()

    def update_batch(self, out: SchedulerOutput) -> np.ndarray:
        """Applies the step's diffs to the persistent batch: rows of finished and preempted
        requests freed, rows of entering requests written, new blocks appended. Returns the
        scheduled requests' rows, in batch order."""
        ib = self.input_batch
        for rid in out.finished_request_ids:
            ib.remove(rid)
        for rid in out.preempted_request_ids:
            ib.remove(rid)
        for new in out.new_requests:
            ib.add(new)
        return ib.apply(out.requests)

    def prepare(self, out: SchedulerOutput, rows: np.ndarray) -> PreparedStep:
        """The step's padded inputs, gathered from the batch rows, and which requests sample
        (their chunk reaches the end of their sequence, not counting draft tokens).

        Sampling happens per logit row: one per request, after its last scheduled token, and
        with draft tokens one more per draft (row j samples the token after j drafts, with the
        request's parameters, counter and history as they would be at that token)."""
        ib = self.input_batch
        num_reqs = len(out.requests)
        computed = np.fromiter((s.num_computed_tokens for s in out.requests), np.int32, num_reqs)
        lens = np.fromiter((s.num_scheduled_tokens for s in out.requests), np.int32, num_reqs)
        num_drafts = np.fromiter((len(s.spec_token_ids) for s in out.requests), np.int32, num_reqs)
        num_tokens = int(lens.sum())
        t_pad, r_pad = pick_shape(num_tokens, num_reqs, self.shapes)
        batch = self._padding_batch(t_pad, r_pad)
        attn = batch.attn

        starts = np.zeros(num_reqs + 1, np.int32)
        np.cumsum(lens, out=starts[1:])
        owner = np.repeat(np.arange(num_reqs), lens)  # the request of each token
        pos = computed[owner] + np.arange(num_tokens, dtype=np.int32) - starts[owner]
        token_rows = rows[owner]
        ids = ib.token_ids[token_rows, pos]
        # A placeholder (-1): the token the previous step samples, not back on the host yet.
        batch.input_ids[:num_tokens] = np.maximum(ids, 0)
        batch.token_src[:num_tokens] = np.where(ids < 0, token_rows, -1)
        batch.positions[:num_tokens] = pos
        attn.slot_mapping[:num_tokens] = (
            ib.block_table[token_rows, pos // self.page_size] * self.page_size
            + pos % self.page_size
        )
        attn.num_seqs[0] = num_reqs
        attn.cu_q_lens[:num_reqs] = starts[:num_reqs]
        attn.cu_q_lens[num_reqs:] = num_tokens  # padding requests: empty, after the last token
        attn.seq_lens[:num_reqs] = computed + lens
        attn.block_tables[:num_reqs] = ib.block_table[rows]

        # Logit rows: request i has 1 + num_drafts[i], from first_row[i]; its row j samples
        # the token after its last token and its first j drafts.
        first_row = np.zeros(num_reqs + 1, np.int32)
        np.cumsum(1 + num_drafts, out=first_row[1:])
        num_logits = int(first_row[-1])
        req = np.repeat(np.arange(num_reqs), 1 + num_drafts)  # the request of each logit row
        j = np.arange(num_logits, dtype=np.int32) - first_row[req]
        batch.logits_indices[:num_logits] = starts[req + 1] - 1 - num_drafts[req] + j

        samples = computed + lens - num_drafts == ib.num_tokens[rows]
        lrows = rows[req]
        seq_len = ib.num_tokens[lrows] + j  # each row's sequence, its drafts included
        sampling, verify = self._padding_sampling(len(batch.logits_indices))
        num_output = seq_len - ib.num_prompt_tokens[lrows]
        sampling.temperature[:num_logits] = ib.temperature[lrows]
        sampling.top_k[:num_logits] = ib.top_k[lrows]
        sampling.top_p[:num_logits] = ib.top_p[lrows]
        sampling.min_p[:num_logits] = ib.min_p[lrows]
        sampling.seeds[:num_logits] = ib.seeds[lrows]
        sampling.counters[:num_logits] = num_output
        sampling.logprobs[:num_logits] = ib.num_logprobs[lrows] >= 0
        blocked = num_output < ib.min_tokens[lrows]  # EOS and stop ids wait for min_tokens
        sampling.blocked_ids[:num_logits] = np.where(
            blocked[:, None], ib.blocked_ids[lrows], self.config.vocab_size
        )
        sampling = self._fill_penalty_inputs(sampling, lrows, samples[req], seq_len)
        sampling = self._fill_bitmask(sampling, out, first_row)
        # Verification: row j is kept if rows 0..j-1 of its request sampled their drafts.
        has_draft = j < num_drafts[req]
        draft_pos = np.minimum(seq_len, ib.token_ids.shape[1] - 1)
        verify.drafts[:num_logits] = np.where(has_draft, ib.token_ids[lrows, draft_pos], -1)
        verify.first_rows[:num_logits] = first_row[req]
        # A decode without drafts leaves its token on the device for the next step to read
        # (async scheduling; an engine with speculative decoding steps synchronously).
        single = samples & (num_drafts == 0)
        verify.sample_rows[first_row[:-1][single]] = rows[single]
        return PreparedStep(batch, sampling, verify, samples, first_row, num_drafts)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Runs one step and waits for it: `fetch(launch(out))`."""
        return self.fetch(self.launch(out))

    def launch(self, out: SchedulerOutput) -> InflightStep:
        """Applies the step's diffs to the batch and dispatches its programs without waiting
        for them. Each request that samples gets a placeholder token in its row, which the
        next step may already consume on the device (see `BatchInputs.token_src`)."""
        ib = self.input_batch
        rows = self.update_batch(out)
        step = self.prepare(out, rows)
        (sampling_reqs,) = np.nonzero(step.samples)
        with self._recovering():
            last, hidden, self.kv_cache = self._forward(
                self._params, self.kv_cache, self.last_tokens, step.batch
            )
            result, self.last_tokens = self._sample(
                self._params, last, step.sampling, step.verify, self.last_tokens
            )
            drafts = None
            if self.drafter is not None:
                drafts = self.drafter.launch(step, rows, result[0].sampled, result[1])
            scoring = self._launch_scoring(out, hidden, len(step.batch.input_ids))
        self.num_scheduled_tokens += out.total_num_scheduled_tokens
        self.num_padded_tokens += len(step.batch.input_ids)
        sampling_rows = rows[sampling_reqs]
        positions = ib.num_tokens[sampling_rows]
        ib.token_ids[sampling_rows, positions] = -1
        ib.num_tokens[sampling_rows] += 1
        return InflightStep(
            out,
            sampling_reqs,
            sampling_rows,
            positions,
            ib.num_logprobs[sampling_rows],
            step.first_row[sampling_reqs],
            step.num_drafts[sampling_reqs],
            result,
            scoring,
            drafts,
        )

    def fetch(self, step: InflightStep) -> RunnerOutput:
        """Waits for a launched step: the tokens sampled for every request whose scheduled
        chunk reached the end of its sequence (written over their placeholders; with draft
        tokens, the accepted drafts and the token after them), their logprobs when asked, the
        prompt tokens the chunks scored (prompt_logprobs), and the next step's drafts."""
        ib = self.input_batch
        reqs, rows, num_logprobs = step.sampling_reqs, step.rows, step.num_logprobs
        waiting_since = time.perf_counter()
        with self._recovering():
            result, kept = step.result
            if (num_logprobs >= 0).any():
                result = jax.device_get(result)
                all_tokens = result.sampled
            else:  # only the tokens cross (one transfer instead of five)
                result, all_tokens = None, np.asarray(result.sampled)
            kept = np.asarray(kept) if step.num_drafts.any() else None
            prompt_logprobs = self._fetch_scoring(step.out, step.scoring)
            draft_tokens = None if step.drafts is None else np.asarray(step.drafts)[reqs]
        self.device_wait_seconds += time.perf_counter() - waiting_since
        ids = [step.out.requests[i].request_id for i in reqs]
        first, num_drafts = step.first_rows, step.num_drafts
        if num_drafts.any():  # the accepted drafts' rows, then the one after them
            kept_rows = [
                np.arange(f, f + 1 + k)[kept[f : f + 1 + k]]
                for f, k in zip(first.tolist(), num_drafts.tolist(), strict=True)
            ]
            tokens = [all_tokens[r].tolist() for r in kept_rows]
        else:
            kept_rows = first[:, None]
            tokens = [[t] for t in all_tokens[first].tolist()]
        sampled = dict(zip(ids, tokens, strict=True))
        logprobs = {}
        for n in np.flatnonzero(num_logprobs >= 0).tolist():
            top = int(num_logprobs[n])
            logprobs[ids[n]] = [
                TokenLogprobs(
                    float(result.logprob[i]),
                    int(result.rank[i]),
                    result.top_ids[i, :top].tolist(),
                    result.top_logprobs[i, :top].tolist(),
                )
                for i in kept_rows[n].tolist()
            ]
        # Rows still held by their request (one finished or preempted since then may have
        # handed its row to another).
        held = np.fromiter(
            (ib.row_of.get(rid) == row for rid, row in zip(ids, rows, strict=True)),
            np.bool_,
            len(ids),
        )
        if not num_drafts.any():
            ib.token_ids[rows[held], step.positions[held]] = all_tokens[first[held]]
        else:
            for n in np.flatnonzero(held).tolist():
                row, pos, k = int(rows[n]), int(step.positions[n]), int(num_drafts[n])
                end = pos + len(tokens[n])
                ib.token_ids[row, pos:end] = tokens[n]
                ib.token_ids[row, end : pos + k] = self.config.vocab_size  # rejected drafts
                ib.num_tokens[row] = end
        drafts = {}
        if draft_tokens is not None:
            drafts = {ids[n]: draft_tokens[n].tolist() for n in np.flatnonzero(held).tolist()}
        if self.proposer is not None:
            for n in np.flatnonzero(held).tolist():
                row = int(rows[n])
                drafts[ids[n]] = self.proposer.propose(ib.token_ids[row, : ib.num_tokens[row]])
        return RunnerOutput(sampled, logprobs, prompt_logprobs, drafts)

    @contextlib.contextmanager
    def _recovering(self):
        """A failed step may take the buffers it was donated with it: start from fresh ones so
        the engine can serve again (the caller drops every cached prefix)."""
        try:
            yield
        except BaseException:
            if any(a.is_deleted() for a in jax.tree.leaves(self.kv_cache)):
                self.kv_cache = self._zeros_cache(self.kv_cache.shape, self.kv_cache.dtype)
                self.kv_cache_lost = True
            drafter = self.drafter
            if drafter is not None and any(
                a.is_deleted() for a in jax.tree.leaves(drafter.kv_cache)
            ):
                drafter.kv_cache = self._zeros_cache(drafter.kv_cache.shape, drafter.kv_cache.dtype)
                self.kv_cache_lost = True
            if self.last_tokens.is_deleted():
                self.last_tokens = self._zeros_last_tokens()
            raise

    def _launch_scoring(self, out: SchedulerOutput, hidden: jax.Array, t_pad: int):
        """prompt_logprobs: dispatches the scorer over the step's hidden states when a chunk
        scores prompt tokens; (targets, device results) or None."""
        if not any(s.prompt_logprob_targets for s in out.requests):
            return None
        targets = np.full(t_pad, -1, np.int32)
        start = 0
        for s in out.requests:
            if s.prompt_logprob_targets:
                targets[start : start + s.num_scheduled_tokens] = s.prompt_logprob_targets
            start += s.num_scheduled_tokens
        return targets, self._score(self._params, hidden, targets)

    def _fetch_scoring(self, out: SchedulerOutput, scoring) -> dict[str, list]:
        if scoring is None:
            return {}
        targets, results = scoring
        logprob, rank, top_ids, top_lps = jax.device_get(results)
        ib = self.input_batch
        scored: dict[str, list[PromptTokenLogprobs]] = {}
        start = 0
        for s in out.requests:
            n = s.num_scheduled_tokens
            if s.prompt_logprob_targets and s.request_id in ib.row_of:
                k = int(ib.num_prompt_logprobs[ib.row_of[s.request_id]])
                scored[s.request_id] = [
                    PromptTokenLogprobs(
                        int(targets[t]),
                        float(logprob[t]),
                        int(rank[t]),
                        top_ids[t, :k].tolist(),
                        top_lps[t, :k].tolist(),
                    )
                    for t in range(start, start + n)
                    if targets[t] >= 0
                ]
            start += n
        return scored


@dataclasses.dataclass
class PreparedStep:
    """A step's inputs, as `ModelRunner.prepare` builds them."""

    batch: BatchInputs
    sampling: SamplingInputs  # per logit row
    verify: VerifyInputs  # per logit row
    samples: np.ndarray  # bool[R]: the request's chunk reaches the end of its sequence
    first_row: np.ndarray  # i32[R + 1]: each request's first logit row, then their number
    num_drafts: np.ndarray  # i32[R]


@dataclasses.dataclass
class InflightStep:
    """A launched step: what `ModelRunner.fetch` needs to collect its results."""

    out: SchedulerOutput
    sampling_reqs: np.ndarray  # indices into out.requests of the requests that sample
    rows: np.ndarray  # their batch rows
    positions: np.ndarray  # where their sampled tokens go in their rows
    num_logprobs: np.ndarray  # the logprobs each asked for (-1: none), read at launch
    first_rows: np.ndarray  # their first logit rows
    num_drafts: np.ndarray  # their draft tokens
    result: Any  # (the sampler's output, the logit rows kept), on the device
    scoring: Any  # prompt_logprobs: (targets, device results), or None
    drafts: Any  # a draft model's drafts, i32[R, k] on the device, or None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyInputs:
    """Per logit row: where its token goes on the device, and which draft it verifies."""

    sample_rows: jax.Array  # i32[L]  batch row whose `last_tokens` entry gets it, else dropped
    drafts: jax.Array  # i32[L]  the draft the row's token must equal for the next row; -1: none
    first_rows: jax.Array  # i32[L]  the first logit row of the row's request


def _ints(*shape: int, fill: int = 0) -> np.ndarray:
    return np.full(shape, fill, np.int32)


_PROGRAMS_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """One compiled program and what its compiler says of it (per device). On a target that is
    not here (`jaxllm.aot`) the cost figures are the compiler's predictions, not measurements."""

    name: str  # forward, head_and_sample, prompt_scorer, draft_step
    shape: tuple  # its bucket: (tokens, requests) or (rows,)
    compile_seconds: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs that reuse a donated input's buffer (the KV cache)
    temp_bytes: int
    code_bytes: int
    flops: float | None  # the compiler's cost analysis, where it gives one
    bytes_accessed: float | None  # in every memory the program touches (a TPU's VMEM too)
    optimal_seconds: float | None  # the compiler's own estimate of its run time (XLA:TPU)
    updates_cache: bool  # takes the donated KV cache and returns it
    cache_bytes: int = 0  # per device, of the KV cache it updates (the draft model's, or not)
    cache_copy_ops: tuple[str, ...] = ()  # its instructions that copy the cache, if any
    scales_copy_ops: tuple[str, ...] = ()  # those that copy an 8-bit cache's scales

    @classmethod
    def of(
        cls, name: str, shape: tuple, compiled, seconds: float, *, updates_cache: bool
    ) -> CompiledProgram:
        m = compiled.memory_analysis()
        try:
            cost = compiled.cost_analysis() or {}
        except Exception:  # some backends have none
            cost = {}
        if isinstance(cost, list):  # older JAX: one dict per device
            cost = cost[0] if cost else {}
        return cls(
            name,
            tuple(shape),
            seconds,
            m.argument_size_in_bytes,
            m.output_size_in_bytes,
            m.alias_size_in_bytes,
            m.temp_size_in_bytes,
            m.generated_code_size_in_bytes,
            cost.get("flops"),
            cost.get("bytes accessed"),
            cost.get("optimal_seconds"),
            updates_cache,
        )

    def describe(self) -> str:
        text = f"{self.alias_bytes / 2**20:.1f} MiB aliased, {self.temp_bytes / 2**20:.1f} MiB of "
        text += "temporaries"
        if self.cache_copy_ops:
            text += f", copied by {', '.join(self.cache_copy_ops[:3])}"
        return text


# Compiled HLO text: a computation's first line, and an instruction with an array result (its
# name, dimensions and opcode).
_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) \(")
_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]\S* ([\w-]+)\(")
# What makes a KV-cache-shaped array without copying the cache: the argument itself, a view of
# it, in-place updates, and fusions whose root is one; custom calls (the kernels) alias their
# outputs to operands or make none of the cache's shape.
_IN_PLACE = {"parameter", "bitcast", "get-tuple-element", "scatter", "dynamic-update-slice"}


def cache_copy_ops(hlo_text: str, shapes: list[tuple[int, ...]]) -> tuple[str, ...]:
    """The instructions of compiled HLO text (`Compiled.as_text()`, per device) that make a new
    array of one of `shapes` (the KV cache's arrays): copies, converts, transposes, and fusions
    that do not update their operand in place. Fusions' own computations are not read: what a
    fusion makes is judged by its root."""
    dims = {",".join(map(str, s)) for s in shapes}
    roots: dict[str, str] = {}  # computation -> its root's opcode
    fused: set[str] = set()  # computations that are fusions' bodies
    candidates: list[tuple[str, str, str, str]] = []  # (computation, name, opcode, called)
    computation = ""
    for line in hlo_text.splitlines():
        if m := _HLO_COMPUTATION.match(line):
            computation = m.group(1)
            continue
        called = re.search(r"calls=%([\w.-]+)", line)
        if " fusion(" in line and called:
            fused.add(called.group(1))
        if (m := _HLO_INSTRUCTION.match(line)) is None:
            continue
        name, shape, opcode = m.groups()
        if line.lstrip().startswith("ROOT "):
            roots[computation] = opcode
        # A result in another memory space (`S(1)`: a TPU's VMEM) is a prefetch of a cache
        # small enough to fit there, not a second copy of it in HBM.
        in_hbm = "S(1)" not in line.split(" = ", 1)[1].split(" ", 1)[0]
        if shape in dims and in_hbm and opcode not in _IN_PLACE | {"custom-call"}:
            candidates.append((computation, name, opcode, called.group(1) if called else ""))
    return tuple(
        f"{opcode} %{name}"
        for computation, name, opcode, called in candidates
        if computation not in fused and not (opcode == "fusion" and roots.get(called) in _IN_PLACE)
    )


def _merge(graphdef, params_def, params: list[jax.Array]) -> nnx.Module:
    return nnx.merge(graphdef, jax.tree.unflatten(params_def, params))


def _forward(graphdef, params_def, mesh, params, kv_cache, last_tokens, batch: BatchInputs):
    """The layers: (hidden states of the rows to sample from [R, D], all hidden states [T, D],
    the updated cache)."""
    model = _merge(graphdef, params_def, params)
    src = batch.token_src
    input_ids = jnp.where(src >= 0, last_tokens[jnp.maximum(src, 0)], batch.input_ids)
    hidden, kv_cache = model(input_ids, batch.positions, kv_cache, batch.attn)
    if mesh is not None:
        hidden = jax.lax.with_sharding_constraint(hidden, sharding.replicated(mesh))
    return hidden[batch.logits_indices], hidden, kv_cache


def _head_and_sample(
    graphdef,
    params_def,
    mesh,
    params,
    last: jax.Array,  # [L, D]
    sampling: SamplingInputs,
    verify: VerifyInputs,
    last_tokens: jax.Array,  # i32[max_num_seqs]
):
    """((the sampler's output, bool[L]: the rows whose tokens the step keeps), `last_tokens`
    with each decode's token at its batch row).

    A row is kept when every earlier row of its request sampled the draft it verifies (see
    `jaxllm.spec_decode`): the accepted drafts' rows and the one after them."""
    model = _merge(graphdef, params_def, params)
    logits = model.compute_logits(last)
    if mesh is not None:  # split on the vocabulary by the head: gather it for the sampler
        logits = jax.lax.with_sharding_constraint(logits, sharding.replicated(mesh))
    result = sample(logits, sampling)
    mismatch = (result.sampled != verify.drafts).astype(jnp.int32)
    before = jnp.cumsum(mismatch) - mismatch  # mismatches in the rows before each row
    kept = before == before[verify.first_rows]
    last_tokens = last_tokens.at[verify.sample_rows].set(result.sampled, mode="drop")
    return (result, kept), last_tokens


def _score_prompt(graphdef, params_def, params, hidden: jax.Array, targets: jax.Array):
    """prompt_logprobs: for each token row, the logprob and rank of `targets` (the next prompt
    token; -1 rows are ignored) and the top MAX_LOGPROBS, from the raw logits."""
    model = _merge(graphdef, params_def, params)
    return token_logprobs(model.compute_logits(hidden), jnp.maximum(targets, 0))

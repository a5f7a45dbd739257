"""The model runner: SchedulerOutput -> padded device arrays -> jitted programs -> tokens.

Only what every model and every request needs lives here: the runner sequences a step
(update the persistent batch, prepare its inputs, launch its programs, fetch their results)
and compiles every program at warmup. Each feature has a module of its own beside it, and the
rarer a feature, the further from this file it sits (vLLM model runner V2's rule):

- `features`: the one interface the runner drives its feature modules through (the modules
  below from `prompt_logprobs` on, and the image encoder `mm_encoder`);
- `buckets`: the compiled shapes every batch pads to;
- `programs`: the pure functions the step runs (forward, head and sampler, prompt scorer);
- `compiler`: compiling them, what the compiler says of each, the in-place check;
- `device_state`: the model cache (`jaxllm.models.ModelCache`) and the last sampled tokens
  on the devices, and recovery;
- `input_batch`: the persistent batch, one row of host arrays per request;
- `step_inputs`: a step's padded inputs gathered from those rows;
- `sampling_inputs`, `sampler`: the sampler's per-row inputs (one table of neutral values),
  and the on-device sampler;
- `prompt_logprobs`: scoring prompt tokens;
- `hidden_pooler`: a decoder served for pooling: its chunks' hidden states pooled;
- `kv_offload`: the host-RAM tier of the prefix cache: blocks copied out and back;
- `spec_decode/`: draft proposers (n-gram, draft model) and the verification of drafts.

The model is split once (`nnx.split`) and its parameters kept as a flat list of arrays: a call
flattens a list in C++, while an nnx.State flattens through Python per variable (about 1 ms a
step on the demo model). A step runs two programs: the forward pass per (token, request) shape,
with the cache donated so it is updated in place, and the output head with the sampler per
logit bucket (see `programs`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxllm.config import ModelConfig, using_kernels
from jaxllm.models import ModelCache, StepExtras
from jaxllm.models.linear_attention import LinearState
from jaxllm.models.vision import VisionEncoder
from jaxllm.quantization import QArray, matmul_implementation
from jaxllm.worker.buckets import logit_rows, make_buckets
from jaxllm.worker.compiler import CompileCounter, CompiledProgram, Compiler
from jaxllm.worker.device_state import DeviceState
from jaxllm.worker.features import Feature, LaunchedForward, Warmup
from jaxllm.worker.hidden_pooler import HiddenPooler
from jaxllm.worker.input_batch import InputBatch
from jaxllm.worker.kv_offload import KVOffloader
from jaxllm.worker.lora_slots import LoRASlots
from jaxllm.worker.mm_encoder import MMEncoder
from jaxllm.worker.plan import EnginePlan
from jaxllm.worker.programs import forward, head_and_sample
from jaxllm.worker.prompt_logprobs import PromptScorer
from jaxllm.worker.sampler import SamplerVariant
from jaxllm.worker.sampling_inputs import SamplingInputsBuilder
from jaxllm.worker.spec_decode import Proposer
from jaxllm.worker.spec_decode.draft_model import DraftModelProposer
from jaxllm.worker.spec_decode.heads import HeadProposer
from jaxllm.worker.spec_decode.ngram import NgramProposer
from jaxllm.worker.spec_decode.verification import accepted_rows
from jaxllm.worker.step_data import RunnerOutput, SchedulerOutput, TokenLogprobs
from jaxllm.worker.step_inputs import PreparedStep, StepInputs
from pallas_kernels import get_kv_cache_shape


def _work_grows_with_rows(model: nnx.Module) -> bool:
    """Whether a step's cost grows with its rows from the first: quantized weights through the
    CPU's native kernel (the one `qmatmul` picks under the model's kernel choices), which is
    bound by its arithmetic (XLA's float matmuls there, and every matmul on an accelerator,
    stream the weights at about the same cost for 1 to 16 rows)."""
    leaves = jax.tree.leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, QArray))
    if not any(isinstance(x, QArray) for x in leaves):
        return False
    with using_kernels(model.compilation):
        return matmul_implementation() == "native"


class ModelRunner:
    def __init__(
        self,
        model: nnx.Module,
        config: ModelConfig,
        plan: EnginePlan,
        *,
        mesh: Mesh | None = None,
        draft_model: tuple[nnx.Module, Any] | None = None,
        vision: VisionEncoder | None = None,
    ):
        """The runner of `model` (of `config`, as sharded) as `plan` says (see
        `jaxllm.worker.plan`: the engine config with the KV pool sized, the cache's dtype and
        layer groups, the host tier's blocks, the encoder cache, the serving kind). `mesh`:
        the tensor-parallel mesh the model was loaded onto (the KV cache is split over its kv
        heads the same way); None for one device. `draft_model`: the draft model (loaded onto
        the same mesh) and its `ModelConfig`, of the draft_model speculative method; the
        EAGLE-3 head and its `Eagle3Config`, of eagle3; the MTP layer and its `MTPConfig`, of
        mtp. `vision`: an image-text model's vision encoder (see `mm_encoder`)."""
        engine = plan.config
        sched = engine.scheduler
        page_size, num_pages = engine.cache.page_size, plan.num_pages
        max_model_len, max_num_seqs = plan.max_model_len, sched.max_num_seqs
        speculative, lora = engine.speculative.method, engine.lora
        kv_groups = plan.kv_groups
        self.config = config
        self.mesh = mesh
        self.max_model_len = max_model_len
        self.num_speculative_tokens = k = speculative.num_speculative_tokens if speculative else 0
        self.token_buckets, self.request_buckets, self.shapes = make_buckets(
            sched.max_num_batched_tokens, max_num_seqs, k, fine=_work_grows_with_rows(model)
        )
        # The head-and-sampler programs, by rows sampled (`logit_rows` of each shape).
        self.logit_buckets = sorted({logit_rows(shape, k) for shape in self.shapes})
        if speculative is not None and speculative.method in ("eagle3", "mtp"):
            if draft_model is None:
                raise ValueError(
                    f"speculative_config: the {speculative.method} method needs the head"
                )
        if speculative is not None and speculative.method == "eagle3":
            if not hasattr(model, "set_aux_hidden_state_layers"):
                raise ValueError(
                    f"speculative_config: eagle3 does not serve {config.architecture} targets"
                )
            model.set_aux_hidden_state_layers(draft_model[1].aux_layers)
        self.graphdef, state = nnx.split(model)
        self.params, self._params_def = jax.tree.flatten(state)
        platform = next(iter(self.params[0].sharding.device_set)).platform  # the target's
        self.kv_groups = kv_groups
        if speculative and speculative.method == "draft_model" and kv_groups.num_groups > 1:
            raise ValueError("a draft model shares the block tables: one KV cache group only")
        cache_shape = get_kv_cache_shape(
            kv_groups.num_slots,
            num_pages,
            page_size,
            config.cache_kv_heads,
            config.cache_head_dim,
            platform,
            latent=config.latent_attention is not None,
        )
        linear = None
        if config.linear_attention is not None:  # a slot per batch row, then saved states
            dtype = model.embed_tokens.get_value().dtype
            slots = max_num_seqs + plan.num_state_snapshots
            linear = LinearState.shapes(config, slots, dtype)
        self.device = DeviceState(
            self.params[0], mesh, cache_shape, plan.kv_dtype, max_num_seqs, linear
        )
        self.compiler = Compiler(self.device)
        pages_per_seq = -(-max_model_len // page_size)  # the block table's width
        self.input_batch = ib = InputBatch(
            max_num_seqs,
            max_model_len,
            pages_per_seq,
            config.vocab_size,
            kv_groups.num_groups,
            mrope=config.mrope_section is not None,
        )
        self.lora = None
        if lora.enable_lora:
            self.lora = LoRASlots(
                config,
                self.device,
                max_loras=lora.max_loras,
                max_rank=lora.max_lora_rank,
                dtype=model.embed_tokens.get_value().dtype,
                mesh=mesh,
            )
        self.inputs = StepInputs(
            ib,
            SamplingInputsBuilder(ib, self.device, config.vocab_size, max_model_len),
            self.shapes,
            num_pages,
            page_size,
            pages_per_seq,
            k,
            lora=self.lora is not None,
            layer_slots=kv_groups.layer_slots,
            state=config.linear_attention is not None,
            num_state_snapshots=plan.num_state_snapshots,
            mm=vision is not None,
            mm_block=1 if vision is None else vision.config.block_tokens,
            mm_attend=vision is not None and vision.config.bidirectional,
        )
        self.mm = None
        if vision is not None:
            self.mm = MMEncoder(
                vision,
                self.device,
                self.compiler,
                num_blocks=plan.encoder_cache[0],
                budget=plan.encoder_cache[1],
                embeds=engine.multimodal.enable_mm_embeds,
                dtype=model.embed_tokens.get_value().dtype,
            )
        # Counters since start, for metrics: the tokens the steps computed, the token slots of
        # the compiled shapes they ran (the difference is padding), and the seconds `fetch`
        # waited for the device.
        self.num_scheduled_tokens = 0
        self.num_padded_tokens = 0
        self.device_wait_seconds = 0.0
        bound = (self.graphdef, self._params_def, mesh)
        # The cache's output sharding stated, so that JAX aliases the donated cache to its own
        # output. Left to XLA, donated buffers go to any output of their size: at TP 2 an 8-bit
        # cache's scales (8 KiB a device) went to the [32, 64] hidden states, and the new
        # scales were a copy of the whole array every step.
        out_shardings = None
        if mesh is not None:
            cache = jax.tree.map(lambda x: x.sharding, self.device.cache)
            rep = self.device.replicated
            out_shardings = (rep, rep, cache, rep)
        # Each takes its step's buffer with the layout (static) that says where its inputs lie.
        self.forward = jax.jit(
            functools.partial(forward, *bound),
            donate_argnums=(1,),
            out_shardings=out_shardings,
            static_argnames=("layout",),
        )
        # `last_tokens` is not donated (a few KiB): donating a buffer the forward pass still
        # reads made the host wait for that pass before it could dispatch the sampler. One
        # program per sampler variant of the platform (see `SamplerVariant`), tried in order.
        self.sampler_variants = SamplerVariant.for_platform(platform)
        self.head_and_sample = {
            v: jax.jit(functools.partial(head_and_sample, *bound, v), static_argnames=("layout",))
            for v in self.sampler_variants
        }
        self.scorer = PromptScorer(
            self.graphdef, self._params_def, ib, self.compiler, self.token_buckets
        )
        self.pooler = None
        if plan.pooling:
            self.pooler = HiddenPooler(self.compiler, max_num_seqs, self.token_buckets)
        self.offloader = None
        if plan.num_host_blocks:
            self.offloader = KVOffloader(self.device, self.compiler, plan.num_host_blocks)
        self._sleep = None  # asleep: (the weights' shardings, their host copies, the cache's)
        self.proposer: Proposer | None = None
        if speculative is not None and speculative.method == "ngram":
            self.proposer = NgramProposer(
                k, speculative.prompt_lookup_min, speculative.prompt_lookup_max, ib
            )
        elif speculative is not None and speculative.method == "draft_model":
            if draft_model is None:
                raise ValueError("speculative_config: the draft_model method needs the draft")
            self.proposer = DraftModelProposer(
                *draft_model, self.inputs, self.compiler, fills=speculative.may_pause
            )
        elif speculative is not None and speculative.method in ("eagle3", "mtp"):
            embed = self._target_param(model.embed_tokens)
            if speculative.method == "eagle3":
                shared = embed
            else:  # the target's embeddings and output head, for an MTP layer without its own
                # (a tied target's is its embeddings: `MTPConfig` wants the layer's own then)
                head = embed if model.lm_head is None else self._target_param(model.lm_head)
                shared = lambda: (embed(), head())  # noqa: E731
            self.proposer = HeadProposer(
                *draft_model,
                self.inputs,
                self.compiler,
                shared,
                window=kv_groups.windows[0],
                fills=speculative.may_pause,
            )
        # The features this engine serves, driven through one interface (see `features`), in
        # the order their work runs in a step: host blocks back, images encoded, then what
        # reads the hidden states.
        candidates = (self.offloader, self.mm, self.scorer, self.pooler, self.proposer)
        self.features: list[Feature] = [f for f in candidates if f is not None]

    # What the engine reads of the runner's parts.
    page_size = property(lambda self: self.inputs.page_size)
    num_pages = property(lambda self: self.inputs.num_pages)
    pages_per_seq = property(lambda self: self.inputs.pages_per_seq)
    programs = property(lambda self: self.compiler.programs)
    abstract = property(lambda self: self.device.abstract)
    kv_cache_device_bytes = property(lambda self: self.device.kv_cache_device_bytes)
    last_tokens = property(lambda self: self.device.last_tokens)

    @property
    def kv_cache_lost(self) -> bool:
        """A failed step took a KV cache with it (the engine drops every cached prefix, then
        clears this)."""
        return self.device.kv_cache_lost

    @kv_cache_lost.setter
    def kv_cache_lost(self, value: bool) -> None:
        self.device.kv_cache_lost = value

    @property
    def cache(self) -> ModelCache:
        """The model cache (see `jaxllm.models.state`)."""
        return self.device.cache

    @property
    def kv_cache(self):
        """The paged KV cache (the model cache's `kv`)."""
        return self.device.kv_cache

    @kv_cache.setter
    def kv_cache(self, value) -> None:
        self.device.kv_cache = value

    @property
    def state(self) -> nnx.State:
        """The model's parameters (`nnx.merge(runner.graphdef, runner.state)` rebuilds it)."""
        return jax.tree.unflatten(self._params_def, self.params)

    @property
    def num_compilations(self) -> int:
        """XLA compilations in this process so far (all runners and helpers included)."""
        return CompileCounter.count()

    @property
    def num_programs(self) -> int:
        """The bound on compiled programs: a forward pass per shape, the head and sampler per
        logit bucket (the request buckets, without speculative decoding) and sampler variant
        of the platform, and each feature's (one prompt scorer per token bucket, a draft
        model's step per shape, for pooling one pooler per token bucket, the host KV tier's
        copy programs, the image encoder's)."""
        heads = len(self.logit_buckets) * len(self.sampler_variants)
        return len(self.shapes) + heads + sum(f.num_programs for f in self.features)

    def warmup(
        self, *, progress: bool = True, check_in_place: bool = True, decode_only: bool = False
    ) -> float:
        """Compiles (or loads from the persistent cache) every program a batch can need, so
        nothing compiles while serving; the jitted functions reuse these executables when real
        batches arrive. Returns the seconds it took. Raises if a step program would copy the KV
        cache instead of updating it in place (see `CompiledProgram.updates_in_place`), unless
        `check_in_place` is off (`jaxllm compile` reports them instead). `decode_only`: only
        the programs of decode steps (as many tokens as requests), for a quick look at a target
        (`jaxllm compile --programs decode`); an engine that serves needs them all."""
        start = time.perf_counter()
        device, compile_ = self.device, self.compiler.compile
        # Traced for the target as the programs are: jit caches this trace, and a program
        # compiled later for the same inputs reuses it (with the host's kernels, were it not).
        with device.traced_for_target():
            layout = self.inputs.batch_template(*self.shapes[0]).layout
            _, hidden, _, _ = jax.eval_shape(
                functools.partial(self.forward, layout=layout),
                self.params,
                device.cache,
                device.last_tokens,
                layout.abstract(device.replicated),
                self.resident(),
            )

        def rows(n: int) -> jax.ShapeDtypeStruct:  # hidden states shaped as the forward makes them
            return jax.ShapeDtypeStruct(
                (n, *hidden.shape[1:]), hidden.dtype, sharding=device.replicated
            )

        def compile_forward(shape):
            layout = self.inputs.batch_template(*shape).layout
            args = (self.params, device.cache, device.last_tokens)
            packed = layout.abstract(device.replicated)
            compile_(
                "forward", shape, self.forward, *args, packed, self.resident(),
                updates_cache=True, static={"layout": layout},
            )  # fmt: skip

        def compile_head(n, variant):
            layout = self.inputs.head_template(n).layout
            idle = self.inputs.sampling.idle_inputs(n)
            args = (self.params, rows(n), layout.abstract(device.replicated), idle)
            program = self.head_and_sample[variant]
            compile_(
                self.head_name(variant), (n,), program, *args, device.last_tokens,
                static={"layout": layout},
            )  # fmt: skip

        shapes = [s for s in self.shapes if not decode_only or s[0] == s[1]]
        jobs = [functools.partial(compile_forward, shape) for shape in shapes]
        logit_buckets = sorted({logit_rows(s, self.num_speculative_tokens) for s in shapes})
        jobs += [
            functools.partial(compile_head, n, v)
            for n in logit_buckets
            for v in self.sampler_variants
        ]
        if not decode_only:
            warm = Warmup(self.params, self.token_buckets, rows)
            for feature in self.features:
                jobs += feature.warmup_jobs(warm)
        self.compiler.run(jobs, progress=progress)
        if check_in_place:
            self.compiler.check_in_place()
        return time.perf_counter() - start

    # ---- sleep mode ---------------------------------------------------------------------

    @property
    def asleep(self) -> bool:
        return self._sleep is not None

    def sleep(self, *, keep_weights: bool) -> None:
        """Frees the device memory of the weights and the KV cache (vLLM's sleep mode): the
        weights go to host memory (`keep_weights`, level 1) or are dropped (level 2: `wake_up`
        then takes fresh ones); the cache is dropped. The compiled programs stay, so waking
        compiles nothing."""
        if self.asleep:
            return
        if self._other_caches():
            raise ValueError(
                "sleep mode with a draft model or head (EAGLE-3, MTP) is not supported"
            )
        # Each weight's placement, and whether it was committed to it: the programs were
        # compiled for exactly these (an uncommitted weight put back committed recompiles).
        shardings = [p.sharding if p.committed else None for p in self.params]
        # Copies (np.array), not views of buffers about to be freed.
        host = [np.array(p) for p in self.params] if keep_weights else None
        for p in self.params:
            p.delete()
        self.params = []
        self._sleep = (shardings, host, self.device.drop_cache())
        if self.mm is not None:
            self.mm.sleep(keep_weights=keep_weights)

    def wake_up(self, weights: list | None = None, vision_weights: list | None = None) -> None:
        """Puts the weights back (from host memory, or `weights`: the model's flat parameter
        list, freshly loaded, after a level-2 sleep, and `vision_weights` an image-text
        model's encoder's) where they were, and a zero KV cache."""
        if not self.asleep:
            return
        if self.mm is not None:
            self.mm.wake_up(vision_weights)
        shardings, host, cache = self._sleep
        if host is None and weights is None:
            raise ValueError("wake_up: the weights were dropped (level 2); give them")
        source = host if host is not None else weights
        if len(source) != len(shardings):
            raise ValueError(f"wake_up: {len(source)} weights for {len(shardings)} parameters")
        self.params = [jax.device_put(w, s) for w, s in zip(source, shardings, strict=True)]
        self.device.restore_cache(cache)
        self._sleep = None

    def cache_copies(self) -> list[CompiledProgram]:
        """The compiled programs that take the KV cache and would copy it."""
        return self.compiler.cache_copies()

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
        """The step's padded inputs (see `StepInputs.prepare`)."""
        return self.inputs.prepare(out, rows)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Runs one step and waits for it: `fetch(launch(out))`."""
        return self.fetch(self.launch(out))

    def launch(self, out: SchedulerOutput) -> InflightStep:
        """Applies the step's diffs to the batch and dispatches its programs without waiting
        for them. Each request that samples gets a placeholder token in its row, which the
        next step may already consume on the device (see `BatchInputs.token_src`)."""
        ib, device = self.input_batch, self.device
        rows = self.update_batch(out)
        step = self.prepare(out, rows)
        (sampling_reqs,) = np.nonzero(step.samples)
        with device.recovering(self._other_caches()):
            for feature in self.features:
                feature.before_forward(out)
            batch, sampling = device.put(step.buffers)  # the step's inputs, in one transfer
            batch_layout, head_layout = step.layouts
            # The tokens the previous steps sampled, as this step's inputs read them (its
            # placeholders); the head replaces the device's with this step's.
            tokens_in = device.last_tokens
            last, hidden, device.cache, aux = self.forward(
                self.params,
                device.cache,
                tokens_in,
                batch,
                self.resident(),
                layout=batch_layout,
            )
            head = self.head_and_sample[self.sampler_variant(step.needs)]
            result, device.last_tokens = head(
                self.params, last, sampling, step.idle, device.last_tokens, layout=head_layout
            )
            drafts = None
            if self.proposer is not None:
                drafts = self.proposer.launch(
                    step, batch, tokens_in, rows, result[0].sampled, result[1],
                    aux=hidden if aux is None else aux,  # (an MTP layer reads the final states)
                    propose=out.propose_drafts,
                )  # fmt: skip
            launched = LaunchedForward(out, self.params, hidden, len(step.batch.input_ids))
            handles = [feature.after_forward(launched) for feature in self.features]
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
            ib.sampling.num_logprobs[sampling_rows],
            step.first_row[sampling_reqs],
            step.num_drafts[sampling_reqs],
            result,
            drafts,
            handles,
        )

    def fetch(self, step: InflightStep) -> RunnerOutput:
        """Waits for a launched step: the tokens sampled for every request whose scheduled
        chunk reached the end of its sequence (written over their placeholders; with draft
        tokens, the accepted drafts and the token after them), their logprobs when asked, the
        prompt tokens the chunks scored (prompt_logprobs), and the next step's drafts."""
        ib = self.input_batch
        reqs, rows, num_logprobs = step.sampling_reqs, step.rows, step.num_logprobs
        first, num_drafts = step.first_rows, step.num_drafts
        waiting_since = time.perf_counter()
        with self.device.recovering(self._other_caches()):
            result, kept = step.result
            if (num_logprobs >= 0).any():
                result = jax.device_get(result)
                all_tokens = result.sampled
            else:  # only the tokens cross (one transfer instead of five)
                result, all_tokens = None, np.asarray(result.sampled)
            if num_drafts.any():  # the accepted drafts' rows, then the one after them
                kept_rows = accepted_rows(np.asarray(kept), first, num_drafts)
                tokens = [all_tokens[r].tolist() for r in kept_rows]
            else:
                kept_rows = first[:, None]
                tokens = [[t] for t in all_tokens[first].tolist()]
            fetched = {
                f.output: f.fetch(step.out, handle)
                for f, handle in zip(self.features, step.handles, strict=True)
                if f.output is not None
            }
            launched_drafts = step.drafts
            if launched_drafts is not None:
                launched_drafts = jax.device_get(launched_drafts)
        self.device_wait_seconds += time.perf_counter() - waiting_since
        ids = [step.out.requests[i].request_id for i in reqs]
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
        # After the tokens: the n-gram proposer reads them.
        if self.proposer is not None and step.out.propose_drafts:
            held_rows = [(ids[n], int(reqs[n]), int(rows[n])) for n in np.flatnonzero(held)]
            drafts = self.proposer.propose(launched_drafts, held_rows)
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
        return RunnerOutput(
            dict(zip(ids, tokens, strict=True)),
            logprobs,
            draft_token_ids=drafts,
            **fetched,  # the scorer's prompt_logprobs (always), the pooler's pooled
        )

    def head_name(self, variant: SamplerVariant) -> str:
        """The name a head-and-sampler program is recorded by: `head_and_sample`, with its
        variant's where the platform has several (`head_and_sample[greedy]`)."""
        if len(self.sampler_variants) == 1:
            return "head_and_sample"
        return f"head_and_sample[{variant.name}]"

    def sampler_variant(self, needs: SamplerVariant) -> SamplerVariant:
        """The first of the platform's sampler variants that holds what a batch `needs`."""
        return next(v for v in self.sampler_variants if v.covers(needs))

    def resident(self) -> StepExtras:
        """The served features' arrays the forward pass reads from the devices: the adapter
        slots (LoRA), the encoder cache's rows (images)."""
        return StepExtras(
            lora=None if self.lora is None else self.lora.device,
            mm_pool=None if self.mm is None else self.mm.pool,
        )

    def _other_caches(self) -> list:
        """Holders of model caches beside the target's (a draft model's, a head's),
        for recovery."""
        return [self.proposer] if hasattr(self.proposer, "cache") else []

    def _target_param(self, variable: nnx.Variable):
        """One of the target's parameters as the runner holds it now (sleep and wake replace
        the parameter arrays), for a head that shares it."""
        leaves, treedef = jax.tree.flatten(variable.get_value())  # (a QArray: several)
        start = next(i for i, p in enumerate(self.params) if p is leaves[0])
        stop = start + len(leaves)
        return lambda: jax.tree.unflatten(treedef, self.params[start:stop])


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
    drafts: Any  # what the proposer's `launch` returned (a draft model's drafts), or None
    handles: list  # each feature's `after_forward` handle, in the runner's feature order

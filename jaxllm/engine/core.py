"""EngineCore: the loop `schedule -> execute -> update`, one step per call, and the composition
root that builds an engine from an `EngineConfig` (`EngineCore.from_config`).

The offline `LLM` drives it in process; the server's core process (`core_proc.py`) runs the
same class behind a socket. Neither adds anything to it: tokenizing, detokenizing and stop
strings live in the front ends.

Async scheduling (on by default): `step` schedules and launches step N+1 before it collects
step N, so the host's work (scheduling, building inputs, and whatever the caller does with the
outputs) overlaps the device's. A decode row of step N+1 takes the token step N sampled
straight from the device (`ModelRunner.last_tokens`); the scheduler sees that token, and so its
stop checks, one step later, and a step scheduled past a stop is discarded. Outputs are the
same as without it: sampling depends only on a request's seed and token count. Rows with
penalties need their whole history on the host, so a step with such a request runs
synchronously.

A `StepHook` hears of every step before it launches: multi-host serving publishes each step to
the other hosts this way (`multihost.LockstepPublisher`), which replay the same runner calls.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from jaxllm.classifier import ClassifierHead
from jaxllm.config import EngineConfig, ModelConfig
from jaxllm.engine.core_outputs import FinishReason, RequestUpdate, Stats, StepEvents
from jaxllm.engine.input_processor import InputProcessor
from jaxllm.engine.messages import Ready
from jaxllm.engine.request import Request
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.spec_policy import SpeculationPolicy
from jaxllm.engine.state_snapshots import StateSnapshots
from jaxllm.multimodal.processor import check_mm_items
from jaxllm.pooling import (
    PooledState,
    PoolerConfig,
    check_params,
    supported_tasks,
)
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams
from jaxllm.worker import SchedulerOutput

if TYPE_CHECKING:
    from jaxllm.engine.kv_events import ZmqEventPublisher
    from jaxllm.engine.kv_transfer import KVTransfer
    from jaxllm.models.vision import VisionConfig
    from jaxllm.worker import EnginePlan, InflightStep, ModelRunner

logger = logging.getLogger(__name__)


class StepHook(Protocol):
    def on_launch(self, out: SchedulerOutput, *, overlap: bool, wait: bool) -> None:
        """Called before the runner launches `out`. `overlap`: the previous step is still in
        flight (it is collected right after this launch); `wait`: this step is collected at
        once (a synchronous step)."""

    def close(self) -> None:
        """The engine is shutting down."""


@dataclasses.dataclass(frozen=True)
class Served:
    """What an engine built from a config serves (`EngineCore.from_config`)."""

    plan: EnginePlan  # its `config` resolved: max_model_len, num_pages, tensor_parallel_size
    model_config: ModelConfig
    generation_config: dict[str, Any]  # the checkpoint's generation_config.json
    mesh: Any  # the tensor-parallel mesh, or None
    vision: VisionConfig | None = None  # an image-text model's vision side


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        served: Served | None = None,
        *,
        async_scheduling: bool = True,
        hook: StepHook | None = None,
        is_worker: bool = False,
        warmup_seconds: float | None = None,
        kv_events: ZmqEventPublisher | None = None,
        kv_transfer: KVTransfer | None = None,
    ):
        """The core over a scheduler and a runner; `served`: what `from_config` loaded and
        planned (None for a core over parts made by hand: no input checks, no pooling). A
        multi-host run's host 0 has the lockstep publisher as its `hook`; the other hosts'
        cores are workers (`is_worker`: they run `multihost.run_worker`)."""
        self.scheduler = scheduler
        self.runner = runner
        self.served = served
        self.async_scheduling = async_scheduling
        self.hook = hook
        self.is_worker = is_worker
        self.warmup_seconds = warmup_seconds
        self.kv_events = kv_events  # publishes each step's KV events (`kv_events.py`)
        # Prefill/decode disaggregation (`kv_transfer.py`): holds, serves and pulls blocks.
        self.kv_transfer = kv_transfer
        scheduler.kv_transfer = kv_transfer
        self.num_steps = 0
        self.last_step = StepEvents()  # what metrics need of the last `step`
        self._inflight: tuple[SchedulerOutput, InflightStep] | None = None
        self.sleep_level = 0  # sleep mode (see `sleep`)
        plan = None if served is None else served.plan
        self.config: EngineConfig | None = None if plan is None else plan.config
        self.model_config: ModelConfig | None = None if served is None else served.model_config
        # The server may replace it (--generation-config).
        self.generation_config: dict[str, Any] = {} if served is None else served.generation_config
        self.mesh = None if served is None else served.mesh
        self.vision: VisionConfig | None = None if served is None else served.vision
        # How a decoder served for pooling pools (and a classifier's head); None: it
        # generates.
        self.pooler: PoolerConfig | None = None if plan is None else plan.pooler
        self.head: ClassifierHead | None = None if plan is None else plan.head
        # The front end's checks, which the core applies again to what it is handed (a
        # library caller of the core, or a front end with a bug, must not fail a step).
        self.input_processor: InputProcessor | None = None
        if served is not None:
            self.input_processor = InputProcessor(
                None,
                eos_token_ids=(),
                vocab_size=served.model_config.vocab_size,
                max_model_len=plan.max_model_len,
            )

    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineCore:
        """Builds the whole engine: joins a multi-host run if asked, loads the model onto its
        mesh, sizes the KV cache, builds the runner, KV cache manager and scheduler, compiles
        every program (unless `skip_warmup`), and on host 0 of a multi-host run waits for the
        other hosts to join the lockstep channel."""
        import jax

        import pallas_kernels
        from jaxllm.compilation_cache import setup_compilation_cache
        from jaxllm.config import resolve_dtype
        from jaxllm.config.kv_events import KVEventsConfig
        from jaxllm.config.kv_transfer import KVTransferConfig
        from jaxllm.engine import multihost
        from jaxllm.engine.block_hashing import BlockHasher
        from jaxllm.engine.encoder_cache import EncoderCache
        from jaxllm.engine.host_blocks import HostBlockPool
        from jaxllm.engine.kv_cache_manager import KVCacheManager
        from jaxllm.engine.kv_events import ZmqEventPublisher
        from jaxllm.engine.kv_transfer import KVTransfer
        from jaxllm.loaders import load_model
        from jaxllm.model_files import cache_dir
        from jaxllm.sharding import make_mesh
        from jaxllm.worker import DeviceMemory, ModelRunner, plan_engine, preallocate_gpu_memory

        comp, parallel = config.compilation, config.parallel
        # Before JAX starts: on a GPU, its memory pool is memory_utilization of the device.
        preallocate_gpu_memory(config.cache.memory_utilization)
        xla_cache = comp.compilation_cache_dir
        setup_compilation_cache(cache_dir() / "xla" if xla_cache == "default" else xla_cache)
        if parallel.multihost:
            multihost.initialize_distributed(
                parallel.coordinator_address, parallel.num_processes, parallel.process_id
            )
        multi = jax.process_count() > 1
        tp = parallel.tensor_parallel_size or (jax.device_count() if multi else 1)
        # The kernel choices, resolved for this platform, travel in the config from here on.
        config = config.replace(
            attention_backend=pallas_kernels.resolve_backend(comp.attention_backend),
            tensor_parallel_size=tp,
        )
        mesh = make_mesh(tp) if tp != 1 else None
        loaded = _load_weights(config, mesh)
        vision = _load_vision(config, mesh)
        spec = config.speculative.method
        if vision is not None and spec is not None and spec.method != "ngram":
            raise ValueError(
                f"speculative_config: {spec.method} with image inputs is not supported"
            )
        # The proposer's model and its config, and the config of its KV cache, which shares the
        # target's pages (an EAGLE-3 head's or MTP layer's one layer).
        draft, draft_kv = None, None
        if spec is not None and spec.method == "eagle3":
            from jaxllm.loaders.eagle3 import load_eagle3_head

            draft = load_eagle3_head(
                spec.model,
                loaded.config,
                dtype=loaded.model.embed_tokens.get_value().dtype,
                compilation=config.compilation,
                mesh=mesh,
            )
            draft_kv = draft[1].layer
        elif spec is not None and spec.method == "mtp":
            from jaxllm.loaders.mtp import load_mtp_head

            draft = load_mtp_head(
                spec.model or config.load.model,
                loaded.config,
                dtype=loaded.model.embed_tokens.get_value().dtype,
                compilation=config.compilation,
                mesh=mesh,
                quantization=config.load.quantization,
            )
            draft_kv = draft[1].layer
        elif spec is not None and spec.method == "draft_model":
            from jaxllm.worker import check_draft_config

            draft = load_model(
                spec.model,
                dtype=resolve_dtype(config.load.dtype),
                compilation=config.compilation,
                mesh=mesh,
                load_tokenizer=False,
                load_format=config.load.load_format,
            )
            check_draft_config(loaded.config, draft.config)
            draft, draft_kv = (draft.model, draft.config), draft.config
        # What is left of the device once the weights are on it: the plan sizes the rest.
        device = jax.local_devices()[0]
        plan = plan_engine(
            config,
            loaded.config,
            DeviceMemory.of(config.cache, device),
            dtype=loaded.model.embed_tokens.get_value().dtype,
            mesh=mesh,
            device=device,
            draft_config=draft_kv,
            vision=None if vision is None else vision.config,
            multi=multi,
        )
        config = plan.config
        sched, cache = config.scheduler, config.cache
        events = KVEventsConfig.parse(cache.kv_events_config)
        runner = ModelRunner(
            loaded.model,
            loaded.config,
            plan,
            mesh=mesh,
            draft_model=draft,
            vision=vision,
        )
        encoder_cache = None
        if vision is not None:
            encoder_cache = EncoderCache.for_model(vision.config, config)
        kv = KVCacheManager(
            plan.num_pages,
            cache.page_size,
            windows=runner.kv_groups.windows,
            enable_prefix_caching=cache.enable_prefix_caching,
            host=HostBlockPool(plan.num_host_blocks) if plan.num_host_blocks else None,
            snapshots=(
                StateSnapshots(plan.num_state_snapshots) if plan.num_state_snapshots else None
            ),
            hasher=BlockHasher(cache.prefix_caching_hash_algo),
            events=events is not None and events.enabled,
            # A head's KV at a position is computed with the token after it (vLLM's rule).
            drop_last_hit_block=spec is not None and spec.method in ("eagle3", "mtp"),
        )
        lookahead = runner.num_speculative_tokens if draft is not None else 0
        scheduler = Scheduler(
            sched,
            kv,
            num_lookahead_tokens=lookahead,
            structured_outputs=_structured_outputs(config.load.model, loaded.config),
            loras=_lora_manager(config, runner, multi=multi),
            encoder_cache=encoder_cache,
            speculation=None
            if spec is None
            else SpeculationPolicy(
                spec.num_speculative_tokens,
                adaptive=spec.adaptive,
                disable_by_batch_size=spec.disable_by_batch_size,
            ),
        )
        if runner.num_speculative_tokens:
            logger.info(
                "speculative decoding (%s, %d tokens%s): a speculating step runs synchronously",
                spec.method,
                runner.num_speculative_tokens,
                ", where measured to pay" if spec.adaptive else "",
            )
        if plan.pooler is not None:
            logger.info(
                "served for pooling (%s pooling%s)",
                plan.pooler.pooling_type,
                ", normalized" if plan.pooler.normalize else "",
            )
        logger.info(
            "buckets: tokens %s x requests %s; programs: %d forward shapes %s + %d output "
            "heads + %d prompt scorers = %d",
            runner.token_buckets,
            runner.request_buckets,
            len(runner.shapes),
            runner.shapes,
            len(runner.logit_buckets),
            len(runner.token_buckets),
            runner.num_programs,
        )
        warmup_seconds = None
        if not comp.skip_warmup:
            warmup_seconds = runner.warmup()
            logger.info("warmup: %d programs in %.1f s", runner.num_programs, warmup_seconds)
        hook = None
        if multi and jax.process_index() == 0:
            hook = multihost.LockstepPublisher(
                multihost.lockstep_address(parallel.lockstep_address),
                jax.process_count() - 1,
                multihost.engine_fingerprint(runner),
            )
        vision_config = None if vision is None else vision.config
        publisher = None
        if kv.events is not None and jax.process_index() == 0:  # the scheduler's host
            publisher = ZmqEventPublisher(events, parallel.data_parallel_rank)
        transfer = None
        if cache.kv_transfer_config is not None:  # a host tier is planned for it
            transfer = KVTransfer(
                KVTransferConfig.parse(cache.kv_transfer_config),
                kv,
                runner.offloader,
                rank=parallel.data_parallel_rank,
                tp_size=tp,
            )
        return cls(
            scheduler,
            runner,
            Served(plan, loaded.config, loaded.generation_config, mesh, vision_config),
            async_scheduling=sched.async_scheduling,
            hook=hook,
            is_worker=multi and jax.process_index() != 0,
            warmup_seconds=warmup_seconds,
            kv_events=publisher,
            kv_transfer=transfer,
        )

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def _check_awake(self) -> None:
        if self.sleep_level:
            raise ValueError("the engine is asleep (sleep mode): wake it up first")

    def add_request(self, request: Request) -> None:
        """Queues a generation request; a ValueError (naming the parameter) if it cannot run
        here, before anything of it reaches a batch: one request's bad value must not fail a
        step that carries others."""
        self._check_awake()
        if self.pooler is not None:
            raise ValueError(
                "this model is served for pooling (embeddings), not generation (--runner)"
            )
        if self.input_processor is not None:
            self.input_processor.check_prompt(request.prompt_token_ids)
            self.input_processor.check_params(request.sampling_params)
        if request.mm_items or self.vision is not None:
            check_mm_items(
                request.mm_items,
                request.prompt_token_ids,
                self.vision,
                self.config.multimodal.image_limit if self.config is not None else None,
                embeds=self.config is not None and self.config.multimodal.enable_mm_embeds,
            )
        if request.lora is not None:
            if self.scheduler.loras is None:
                raise ValueError("lora_request: this engine serves no LoRA adapters (enable_lora)")
            self.scheduler.loras.prepare(request.lora)
        transfer = self.kv_transfer
        if transfer is not None and transfer.wants_pull(request):
            if request.request_id in self.scheduler.requests or transfer.pulling(request.request_id):  # fmt: skip
                raise ValueError(f"request_id {request.request_id!r} is already in the engine")
            if transfer.start_pull(request):
                return  # queued once its blocks are in (`poll_transfers`)
        self.scheduler.add_request(request)

    def poll_transfers(self) -> list[RequestUpdate]:
        """Prefill/decode disaggregation's work between steps (`kv_transfer.KVTransfer.poll`):
        serves decoders' pulls, and queues the requests whose own pulls ended. Returns the
        updates of requests a failed pull failed."""
        if self.kv_transfer is None:
            return []
        ready, failed = self.kv_transfer.poll()
        updates = [
            RequestUpdate(r.request_id, [], finish_reason=FinishReason.ERROR) for r in failed
        ]
        for request in ready:
            try:
                self.scheduler.add_request(request)
            except Exception as e:  # (a grammar that does not compile)
                logger.warning("request %s refused: %s", request.request_id, e)
                self.scheduler.kv.forget(request)
                updates.append(
                    RequestUpdate(request.request_id, [], finish_reason=FinishReason.ERROR)
                )
        return updates

    @property
    def is_pooling(self) -> bool:
        """Served for pooling (`--runner pooling`, or a checkpoint that pools): it takes
        pooling requests, not generation."""
        return self.pooler is not None

    @property
    def hidden_size(self) -> int:
        return self.model_config.hidden_size

    def add_pooling_request(
        self,
        request_id: str,
        token_ids: list[int],
        params: PoolingParams,
        token_type_ids: list[int] | None = None,
    ) -> None:
        """Queues a pooling request: its prompt is computed chunk by chunk under the step's
        token budget, pooled as it goes, and it finishes with its vector (no token sampled,
        no prefix cache lookup: every chunk's hidden states are pooled). A decoder has no
        token types: `token_type_ids` (a text pair's segments) are ignored."""
        if self.pooler is None:
            raise ValueError(
                "this is a generative model: it serves completions, not pooling (embeddings); "
                "serve it with --runner pooling"
            )
        self._check_awake()
        check_params(params, self.hidden_size, self.head)
        if self.input_processor is not None:
            self.input_processor.check_pooling_ids(token_ids)
        request = Request(
            request_id, token_ids, SamplingParams(max_tokens=1), eos_token_ids=(), max_tokens=1,
            seed=0,
        )  # fmt: skip
        request.pooling_params = params
        request.pooled = PooledState(self.pooler, self.head)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)
        if self.kv_transfer is not None:
            self.kv_transfer.abort(request_ids)

    def running_request_ids(self) -> list[str]:
        """The requests a step in progress holds (a failed step fails them)."""
        return [r.request_id for r in self.scheduler.running]

    def has_unfinished_requests(self) -> bool:
        return (
            self._inflight is not None
            or self.scheduler.has_unfinished_requests()
            or bool(self.scheduler.failed)  # not reported yet
        )

    def forget_lost_cache(self) -> None:
        """After a failed step took the donated KV cache with it (the runner rebuilt it
        empty), the cached prefixes point at nothing: forget them. Call it once the failed
        requests are aborted (a reset needs every block free of requests)."""
        if self.runner.kv_cache_lost:
            if self.kv_transfer is not None:  # the blocks held for decoders are gone too
                self.kv_transfer.release_all()
            self.scheduler.kv.reset_prefix_cache()
            self.runner.kv_cache_lost = False

    # ---- sleep mode -----------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Frees the device memory of the weights and the KV cache while idle (vLLM's sleep
        mode): level 1 keeps the weights in host memory, level 2 drops them (`wake_up`
        reloads them from the checkpoint). Cached prefixes are forgotten, but for the host KV
        tier's; compiled programs are kept. A ValueError if requests are unfinished or `level` is not 1 or 2."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        if self.has_unfinished_requests() or (self.kv_transfer and self.kv_transfer.num_pulling):
            raise ValueError("the engine has unfinished requests: sleep when it is idle")
        if self.sleep_level:
            return
        self.drain()
        if self.kv_transfer is not None:  # the device's blocks go: decoders recompute
            self.kv_transfer.release_all()
        # The host KV tier's copies stay: the same weights come back (level 2 reloads them
        # from the checkpoint), so a prefix they hold is right after waking.
        self.scheduler.kv.reset_prefix_cache(host=False)
        self.publish_kv_events()
        if self.scheduler.encoder_cache is not None:  # the device's encoded images go too
            self.scheduler.encoder_cache.reset()
        self.runner.sleep(keep_weights=level == 1)
        self.sleep_level = level

    def wake_up(self) -> None:
        """Back from `sleep`: the weights where they were (from host memory, or reloaded from
        the checkpoint after level 2) and an empty KV cache; nothing compiles."""
        if not self.sleep_level:
            return
        weights = vision = None
        if self.sleep_level == 2:
            import jax
            from flax import nnx

            weights = jax.tree.leaves(nnx.state(_load_weights(self.config, self.mesh).model))
            if self.vision is not None:
                vision = jax.tree.leaves(nnx.state(_load_vision(self.config, self.mesh)))
        self.runner.wake_up(weights, vision)
        self.sleep_level = 0

    def ready(self) -> Ready:
        """What the front end learns of this engine once it has warmed up."""
        return Ready(
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=list(self.model_config.eos_token_ids),
            num_pages=self.scheduler.kv.num_pages,
            page_size=self.scheduler.kv.page_size,
            num_programs=self.runner.num_programs,
            stats=self.stats(),
            pooling=self.is_pooling,
            hidden_size=self.hidden_size,
            labels=list(self.head.labels) if self.head is not None else [],
            supported_tasks=supported_tasks(self.head) if self.is_pooling else ["generate"],
            image_limit=0 if self.vision is None else self.config.multimodal.image_limit,
        )

    def stats(self) -> Stats:
        scheduler, kv = self.scheduler, self.scheduler.kv
        return Stats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting)
            + (self.kv_transfer.num_pulling if self.kv_transfer else 0),
            kv_cache_usage=1.0 - kv.num_free_blocks / kv.num_pages,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            **_host_tier_stats(kv.host),
            num_preemptions=scheduler.num_preemptions,
            num_compilations=self.runner.num_compilations,
            num_steps=self.num_steps,
            num_scheduled_tokens=self.runner.num_scheduled_tokens,
            num_padded_tokens=self.runner.num_padded_tokens,
            grammar_bitmask_seconds=scheduler.grammar_bitmask_seconds,
            grammar_bitmask_steps=scheduler.grammar_bitmask_steps,
            spec_decoding=scheduler.spec_decoding.copy(),
            sleep_level=self.sleep_level,
            **_lora_stats(scheduler),
            **_encoder_cache_stats(scheduler.encoder_cache),
            **(self.kv_transfer.stats() if self.kv_transfer is not None else {}),
        )

    def step(self) -> list[RequestUpdate]:
        """Runs one step; returns the updates of the step that completed (with async
        scheduling, the one launched by the previous call), and leaves what metrics need of it
        in `last_step`. If it raises, no step is left in flight: the caller fails the running
        requests."""
        start, waited, steps = time.perf_counter(), self.runner.device_wait_seconds, self.num_steps
        updates = self._step()
        self.publish_kv_events()
        # Requests failed outside the step (a grammar that did not compile), reported now.
        failed, self.scheduler.failed = self.scheduler.failed, []
        scheduled, self.scheduler.first_scheduled = self.scheduler.first_scheduled, []
        host = None
        if self.num_steps != steps:
            waited = self.runner.device_wait_seconds - waited
            host = time.perf_counter() - start - waited
        self.last_step = StepEvents(scheduled, host)
        return failed + updates

    def _step(self) -> list[RequestUpdate]:
        try:
            if not self.async_scheduling or self._needs_sync():
                updates = self.drain()
                scheduled = self.scheduler.schedule()
                if scheduled.is_empty:
                    if not updates:
                        self.scheduler.wait_for_grammars(_GRAMMAR_POLL_S)
                    return updates
                self._announce(scheduled, wait=True)
                output = self.runner.execute(scheduled)
                self.num_steps += 1
                return updates + self.scheduler.update_from_output(scheduled, output)
            scheduled = self.scheduler.schedule()
            launched = None
            if not scheduled.is_empty:
                self._announce(scheduled, wait=False)
                launched = self.runner.launch(scheduled)
            updates = self.drain()
            if launched is not None:
                self._inflight = (scheduled, launched)
                self.num_steps += 1
            elif not updates:
                self.scheduler.wait_for_grammars(_GRAMMAR_POLL_S)
            return updates
        except BaseException:
            self._inflight = None
            raise

    def publish_kv_events(self) -> None:
        """Publishes the KV events since the last call as one batch (none: nothing sent)."""
        events = self.scheduler.kv.take_events()
        if self.kv_events is not None:
            self.kv_events.publish(events)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (device and host tier); False, doing nothing, while
        requests hold blocks. Told to KV event subscribers at once."""
        done = self.scheduler.kv.reset_prefix_cache()
        self.publish_kv_events()
        return done

    def drain(self) -> list[RequestUpdate]:
        """Waits for the step in flight, if any (e.g. one launched past the last stop), and
        applies its output. Nothing is left in flight, even if it raises."""
        if self._inflight is None:
            return []
        scheduled, launched = self._inflight
        self._inflight = None
        return self.scheduler.update_from_output(scheduled, self.runner.fetch(launched))

    def shutdown(self) -> None:
        """Collects the step in flight and tells the hook (a multi-host host 0 releases the
        other hosts). The engine serves nothing afterwards."""
        try:
            self.drain()
        finally:
            if self.scheduler.structured_outputs is not None:
                self.scheduler.structured_outputs.shutdown()
            if self.hook is not None:
                self.hook.close()
            if self.kv_events is not None:
                self.kv_events.shutdown()
            if self.kv_transfer is not None:
                self.kv_transfer.close()

    def _announce(self, scheduled: SchedulerOutput, *, wait: bool) -> None:
        if self.hook is not None:
            self.hook.on_launch(scheduled, overlap=self._inflight is not None, wait=wait)

    def _needs_sync(self) -> bool:
        """Penalties read a request's whole history from the host: with such a request
        running, the next step waits for the previous one's tokens. So do draft tokens
        (speculative decoding): a step's grants depend on how many the previous one accepted;
        and grammars (structured outputs): a step's bitmask follows every token before it."""
        speculating = self.runner.num_speculative_tokens > 0 and self.scheduler.max_drafts() != 0
        return speculating or any(
            r.sampling_params.uses_penalties or r.grammar is not None
            for r in self.scheduler.running
        )


# How long a step with nothing to run waits for a grammar that holds a request back.
_GRAMMAR_POLL_S = 0.05


def _load_weights(config: EngineConfig, mesh):
    """The model of `config`, loaded onto `mesh` (at start, and waking from a level-2 sleep)."""
    from jaxllm.config import resolve_dtype
    from jaxllm.loaders import load_model

    return load_model(
        config.load.model,
        dtype=resolve_dtype(config.load.dtype),
        compilation=config.compilation,
        mesh=mesh,
        load_tokenizer=False,
        quantization=config.load.quantization,
        load_format=config.load.load_format,
    )


def _load_vision(config: EngineConfig, mesh):
    """An image-text checkpoint's vision encoder (None for a text model)."""
    from jaxllm.config import resolve_dtype
    from jaxllm.loaders.vision import load_vision_encoder, vision_config
    from jaxllm.model_files import resolve_model

    path = resolve_model(config.load.model)
    vision = vision_config(path, config.multimodal.mm_processor_kwargs)
    if vision is None:
        return None
    if config.load.load_format == "dummy":
        raise ValueError("load_format dummy: an image-text model's vision encoder is not made")
    dtype = resolve_dtype(config.load.dtype)
    return load_vision_encoder(path, vision, dtype=dtype, mesh=mesh)


def _lora_manager(config: EngineConfig, runner, *, multi: bool):
    """The LoRA adapters' slots and host copies, when the engine serves adapters."""
    from jaxllm.engine.lora_manager import LoRAManager
    from jaxllm.lora import BaseDims, load_adapter

    lora = config.lora
    if not lora.enable_lora:
        return None
    if multi:
        raise ValueError("enable_lora is not supported in a multi-host run")

    dims = BaseDims.of(runner.config)

    def load(request):
        return load_adapter(
            request.lora_path, dims, max_rank=lora.max_lora_rank, name=request.lora_name
        )

    return LoRAManager(lora.max_loras, lora.max_cpu_loras or lora.max_loras, load, runner.lora.set)


def _lora_stats(scheduler) -> dict:
    loras = scheduler.loras
    if loras is None:
        return {}
    waiting = sorted({r.lora.lora_name for r in scheduler.waiting if r.lora is not None})
    return dict(running_loras=loras.running(), waiting_loras=waiting, max_loras=loras.num_slots)


def _encoder_cache_stats(cache) -> dict:
    if cache is None:
        return {}
    return {
        "encoder_cache_queries": cache.hits + cache.misses,
        "encoder_cache_hits": cache.hits,
        "encoder_cache_usage": cache.num_held_blocks / cache.num_blocks,
    }


def _host_tier_stats(host) -> dict:
    if host is None:
        return {}
    return dict(
        prefix_cache_hits_host=host.hit_tokens,
        kv_offload_stored=host.num_stored,
        kv_offload_loaded=host.num_loaded,
        kv_offload_blocks=len(host),
        kv_offload_capacity=host.num_blocks,
    )


def _structured_outputs(model: str, model_config: ModelConfig):
    """The engine's grammar support; the tokenizer loads when a constrained request comes."""
    from jaxllm.engine.input_processor import resolve_eos_token_ids
    from jaxllm.loaders import load_tokenizer
    from jaxllm.structured_outputs import StructuredOutputManager

    def tokenizer():
        tok, generation_config = load_tokenizer(model)
        eos = resolve_eos_token_ids(model_config.eos_token_ids, generation_config, tok)
        return tok, list(eos)

    return StructuredOutputManager(tokenizer, model_config.vocab_size)

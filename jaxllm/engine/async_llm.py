"""`AsyncLLM`: the server's front end to the engine core process.

It owns the tokenizer, turns prompts into the core's requests through the same
`InputProcessor` the offline `LLM` uses (checks, max_tokens, seeds, EOS ids), sends them to
the core, and turns the core's token updates into `RequestOutput` snapshots per request
(incremental detokenization and stop strings through the same `OutputProcessor`).
Each request has a `_Stream` its handler reads with `generate`: a flag that new output is
there, not a queue of outputs, so a handler that falls behind (a client that stops reading)
costs one snapshot, built when it reads, however many tokens came meanwhile. A handler that
leaves (a client that went away) aborts its request, which frees its blocks in the core.

Two background tasks: the output loop (core -> streams) and a watchdog that fails every
in-flight request at once if the core process dies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from jaxllm.config import EngineConfig
from jaxllm.engine.core_client import EngineCoreClient
from jaxllm.engine.core_outputs import FinishReason
from jaxllm.engine.dp_client import DPEngineCoreClient
from jaxllm.engine.input_processor import InputProcessor
from jaxllm.engine.iteration_stats import IterationStats, PromptGroups, RequestTimes
from jaxllm.engine.messages import AddPooling, AddRequest, Ready, Sleep, Stats, WakeUp
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.stat_logger import LoggingStatLogger
from jaxllm.errors import EngineDeadError, RequestFailedError
from jaxllm.loaders import load_tokenizer
from jaxllm.lora import LoRARequest
from jaxllm.model_files import resolve_model
from jaxllm.multimodal.processor import ImageProcessor
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class _Stream:
    """What a request's reader has not taken yet: whether there is new output, or an error."""

    __slots__ = ("error", "ready")

    def __init__(self):
        self.ready = asyncio.Event()
        self.error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()


class AsyncLLM:
    def __init__(
        self,
        client: EngineCoreClient | DPEngineCoreClient,
        ready: Ready,
        tokenizer,
        generation_config: dict,
        config: EngineConfig,
    ):
        self.client = client
        self.ready = ready
        self.config = config
        self.tokenizer = tokenizer
        # The model's sampling defaults (the server may replace them: --generation-config);
        # the EOS ids come from the model's own, whatever the server does with them.
        self.generation_config = generation_config
        self.max_model_len = ready.max_model_len
        self.input_processor = InputProcessor.for_engine(
            tokenizer,
            generation_config,
            ready,
            seed=config.load.seed,
            images=ImageProcessor.for_engine(resolve_model(config.load.model), ready, config),
        )
        self.output_processor = OutputProcessor(tokenizer)
        self.stats: Stats = ready.stats
        # Each engine core's (one per data-parallel rank), for per-rank metrics.
        self.engine_stats: list[Stats] = list(getattr(client, "stats", None) or [ready.stats])
        self._streams: dict[str, _Stream] = {}
        self._pooled: dict[str, asyncio.Future] = {}  # pooling requests: their vectors
        self._outputs_seen = 0  # StepOutputs applied (sleep mode waits for the next one)
        self._prompts: dict[str, list[int]] = {}
        self.dead = False
        # Optional callback(IterationStats) after each step's outputs and each abort, for
        # metrics; the requests' timelines it is made of, and their prompts' completions.
        self.on_step: Callable[[IterationStats], None] | None = None
        self._times: dict[str, RequestTimes] = {}
        self._groups = PromptGroups()
        # vLLM's periodic log lines, one logger per engine core (`stat_logger`).
        self.stat_loggers = (
            []
            if config.observability.disable_log_stats
            else [LoggingStatLogger(i) for i in range(len(self.engine_stats))]
        )
        self._tasks = [
            asyncio.create_task(self._output_loop()),
            asyncio.create_task(self._watchdog()),
        ]
        if self.stat_loggers:
            self._tasks.append(asyncio.create_task(self._log_stats()))

    @classmethod
    async def create(
        cls,
        model: str | EngineConfig,
        *,
        in_process: bool = False,
        **engine_args: Any,
    ) -> AsyncLLM:
        """Starts the engine core (a child process, or a thread with `in_process=True`) and
        waits until it has warmed up. `model` is a model (with the engine's fields as keyword
        arguments, as `LLM` takes them) or a whole `EngineConfig`."""
        if isinstance(model, EngineConfig):
            if engine_args:
                raise TypeError("AsyncLLM.create(config) takes no other engine arguments")
            config = model
        else:
            config = EngineConfig.create(model, **engine_args)
        tokenizer, generation_config = await asyncio.to_thread(load_tokenizer, config.load.model)
        if config.parallel.data_parallel_size > 1:
            client = DPEngineCoreClient(config, in_process=in_process)
        else:
            client = EngineCoreClient(config, in_process=in_process)
        try:
            ready = await client.wait_ready()
        except BaseException:
            await client.shutdown()
            raise
        return cls(client, ready, tokenizer, generation_config, config)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams) + len(self._pooled)

    @property
    def is_pooling_model(self) -> bool:
        """The model pools (an encoder: `encode`), it does not generate."""
        return self.ready.pooling

    @property
    def supported_tasks(self) -> list[str]:
        """What the model serves, by vLLM's task names (see `jaxllm.pooling.supported_tasks`):
        ["generate"], an embedder's ["encode", "embed", "score"], a classifier's
        ["classify", "score"] (score: a cross-encoder's, one label)."""
        return self.ready.supported_tasks

    # ---- generation --------------------------------------------------------------------

    async def generate(
        self,
        prompt: list[int] | AddRequest,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        index: int = 0,
        priority: int = 0,
        prefix_parent: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields a `RequestOutput` when new tokens came: its one completion is a snapshot of
        everything so far (tokens that came while the caller was not reading arrive together;
        the last snapshot has a finish_reason), its prompt_logprobs complete from the first
        on, when asked for. Leaving the loop early aborts the request in the core.

        `prompt`: token ids with their `params` (checked and resolved here by the input
        processor, which raises `InputError` naming the parameter), or a request the input
        processor made already (the server's path: `input_processor.fan_out`). `index` is the
        completion's place among the n of one prompt (it picks the seed); the siblings pass
        the first one's id as `prefix_parent` to share its cached prompt. `lora_request`: the
        LoRA adapter of a prompt given as token ids (an engine with enable_lora)."""
        if self.dead:
            raise EngineDeadError("engine core is not running")
        if isinstance(prompt, AddRequest):
            request = prompt
        else:
            params = SamplingParams() if params is None else params
            self.input_processor.check_prompt(prompt)
            self.input_processor.check_params(params)
            request = self.input_processor.request(
                request_id or f"req-{self.input_processor.next_request_id()}",
                prompt,
                params,
                index=index,
                priority=priority,
                prefix_parent=prefix_parent,
                lora_request=lora_request,
            )
        request_id, params = request.request_id, request.sampling_params
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = self._streams[request_id] = _Stream()
        self._prompts[request_id] = request.prompt_token_ids
        self._times[request_id] = RequestTimes(
            arrival=time.monotonic() if arrival_time is None else arrival_time,
            num_prompt_tokens=len(request.prompt_token_ids),
            max_tokens_param=params.max_tokens,
            n=params.n,
            group=request.prefix_parent or request_id,
        )
        self.output_processor.add_request(request_id, index, request.prompt_token_ids, params)
        finished = False
        try:
            self.client.add_request(request)
            self._times[request_id].engine = self._rank_of(request_id)
            while True:
                await stream.ready.wait()
                stream.ready.clear()
                if stream.error is not None:
                    finished = True
                    raise stream.error
                out = self._snapshot(request_id)
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self._prompts.pop(request_id, None)
            self.output_processor.remove(request_id)
            if not finished and not self.dead:
                self.client.abort([request_id])
            # Still timed: it ended without its last output (left early, or the engine died).
            times = self._times.pop(request_id, None)
            if times is not None:
                stats = IterationStats(engine=times.engine)
                reason = (
                    FinishReason.ABORT if not finished and not self.dead else FinishReason.ERROR
                )
                self._finish(times, reason, stats)
                self._report(stats)

    # ---- sleep mode ---------------------------------------------------------------------

    @property
    def sleep_level(self) -> int:
        return self.stats.sleep_level

    async def sleep(self, level: int = 1, timeout: float = 600.0) -> None:
        """Puts the idle engine to sleep (see `EngineCore.sleep`); raises if it did not
        (unfinished requests, or no answer within `timeout` seconds)."""
        await self._control(Sleep(level), level, timeout)

    async def wake_up(self, timeout: float = 600.0) -> None:
        await self._control(WakeUp(), 0, timeout)

    async def _control(self, message, want: int, timeout: float) -> None:
        """Sends a sleep mode message and waits for the core's stats to show `want`. The core
        answers with one step's outputs; one that still shows another level, and no other
        coming within a second (an output already on its way may precede the answer), means
        it refused."""
        if self.dead:
            raise EngineDeadError("engine core is not running")
        if len(self.engine_stats) > 1:
            raise RuntimeError("sleep mode is not served with data_parallel_size > 1 yet")
        seen = self._outputs_seen
        self.client.send(message)
        deadline = time.monotonic() + timeout
        refused_at = None
        while self.stats.sleep_level != want:
            if self._outputs_seen > seen and refused_at is None:
                refused_at = time.monotonic() + 1.0
            if refused_at is not None and (time.monotonic() > refused_at or
                                           self._outputs_seen > seen + 1):  # fmt: skip
                raise RuntimeError(
                    f"the engine did not {'sleep' if want else 'wake up'}: it has unfinished "
                    "requests"
                )
            if time.monotonic() > deadline or self.dead:
                raise RuntimeError("the engine did not answer the sleep mode request in time")
            await asyncio.sleep(0.02)

    # ---- pooling ------------------------------------------------------------------------

    async def encode(
        self, request: AddPooling, *, arrival_time: float | None = None
    ) -> list[float]:
        """The pooled vector of a pooling request the input processor checked
        (`input_processor.pooling_prompt`). Cancelling the wait aborts the request in the
        core; a request the engine failed raises `RequestFailedError`."""
        if self.dead:
            raise EngineDeadError("engine core is not running")
        if not self.is_pooling_model:
            raise ValueError("this is a generative model: it has no pooled outputs")
        request_id = request.request_id
        if request_id in self._pooled or request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        future = self._pooled[request_id] = asyncio.get_running_loop().create_future()
        self._times[request_id] = RequestTimes(
            arrival=time.monotonic() if arrival_time is None else arrival_time,
            num_prompt_tokens=len(request.prompt_token_ids),
            max_tokens_param=None,
            n=1,
            group=request_id,
        )
        finished = False
        try:
            self.client.add_request(request)
            self._times[request_id].engine = self._rank_of(request_id)
            vector = await future
            finished = True
            return vector
        finally:
            self._pooled.pop(request_id, None)
            if not finished and not self.dead and not future.done():
                self.client.abort([request_id])
            times = self._times.pop(request_id, None)
            if times is not None:  # it ended without its vector
                stats = IterationStats(engine=times.engine)
                reason = FinishReason.ERROR if self.dead else FinishReason.ABORT
                self._finish(times, reason, stats)
                self._report(stats)

    async def _output_loop(self) -> None:
        while True:
            try:
                out = await self.client.get_output()
            except Exception:
                if self.dead:
                    return
                logger.exception("reading engine outputs failed")
                await asyncio.sleep(0.1)
                continue
            if out is None:
                continue
            try:
                self._apply(out)
            except Exception:
                # A bug here would leave every request waiting forever: fail them all and
                # stop, so the server exits and its supervisor restarts it.
                logger.exception("processing engine outputs failed")
                self._die(EngineDeadError("the engine's output processing failed"))
                return

    def _apply(self, out) -> None:
        self.stats = self.engine_stats[out.engine] = out.stats
        self._outputs_seen += 1
        # An idle core's report (stats alone: another host's heartbeat, or after aborts) is
        # no engine step for metrics.
        idle = out.step.host_seconds is None and not out.updates and not out.step.scheduled
        stats = IterationStats(step=None if idle else out.step, engine=out.engine)
        for rid, queued_seconds, at in out.step.scheduled:
            if (times := self._times.get(rid)) is not None:
                times.queued_seconds, times.scheduled = queued_seconds, at
        failed = [u.request_id for u in out.updates if u.finish_reason == FinishReason.ERROR]
        updates = [u for u in out.updates if u.finish_reason != FinishReason.ERROR]
        pooled = [u for u in updates if u.pooled is not None]
        if pooled:
            updates = [u for u in updates if u.pooled is None]
        for u in pooled:
            if (times := self._times.pop(u.request_id, None)) is not None:
                stats.pooled(times)
                self._finish(times, u.finish_reason, stats)
            future = self._pooled.get(u.request_id)
            if future is not None and not future.done():
                future.set_result(u.pooled)
        finished, to_abort = self.output_processor.process(updates)
        if to_abort:  # stop strings: the core must stop generating them
            self.client.abort(to_abort)
        for u in updates:
            if (times := self._times.get(u.request_id)) is not None:
                stats.new_tokens(times, len(u.new_token_ids))
            stream = self._streams.get(u.request_id)
            if stream is not None and (u.new_token_ids or u.finish_reason is not None):
                stream.ready.set()
        for rid in finished:
            if (times := self._times.pop(rid, None)) is not None:
                self._finish(times, self.output_processor.states[rid].finish_reason, stats)
        for rid in failed:
            if (times := self._times.pop(rid, None)) is not None:
                self._finish(times, FinishReason.ERROR, stats)
            stream = self._streams.get(rid)
            if stream is not None:
                stream.fail(RequestFailedError("the engine failed this request"))
            future = self._pooled.get(rid)
            if future is not None and not future.done():
                future.set_exception(RequestFailedError("the engine failed this request"))
        self._report(stats)
        if self.stat_loggers:
            self.stat_loggers[out.engine].record(
                out.stats, stats.num_prompt_tokens, stats.num_generation_tokens
            )

    async def _log_stats(self) -> None:
        while not self.dead:
            await asyncio.sleep(self.stat_loggers[0].interval)
            for stat_logger in self.stat_loggers:
                stat_logger.maybe_log()

    def _rank_of(self, request_id: str) -> int:
        """The data-parallel rank of the core a request was sent to (0 with one core)."""
        owner = getattr(self.client, "owner", None)
        return 0 if owner is None else owner(request_id)

    def _finish(self, times: RequestTimes, reason: FinishReason, stats: IterationStats) -> None:
        stats.finish(times, reason)
        self._groups.finish(times, stats)

    def _report(self, stats: IterationStats) -> None:
        if self.on_step is not None:
            self.on_step(stats)

    def _die(self, error: BaseException) -> None:
        """Nothing can be served any more: every waiting request fails with `error` now."""
        self.dead = True
        for stream in self._streams.values():
            stream.fail(error)
        for future in self._pooled.values():
            if not future.done():
                future.set_exception(error)

    def _snapshot(self, request_id: str) -> RequestOutput:
        out = self.output_processor.output(request_id)
        return RequestOutput(
            request_id=request_id,
            prompt=None,
            prompt_token_ids=self._prompts[request_id],
            outputs=[out],
            finished=out.finish_reason is not None,
            prompt_logprobs=self.output_processor.prompt_logprobs(request_id),
            kv_transfer_params=self.output_processor.kv_transfer_params(request_id),
        )

    async def _watchdog(self) -> None:
        while self.client.is_alive():
            await asyncio.sleep(0.2)
        if self.dead:  # shut down, or failed already
            return
        logger.error("engine core died (%s)", self.client.exit_status)
        self._die(EngineDeadError("engine core process died"))

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.dead = True
        await self.client.shutdown()

"""The engine core of a pooling model (an encoder such as BERT): pooling requests in, each one's
vector out, driven by the same `CoreLoop` as the generative core.

An encoder's request is its prompt alone, encoded whole in one step and finished by it: no KV
cache, no pages, no prefix cache (a bidirectional encoder's states depend on the tokens after
them, so no prefix of one request can serve another). Each step takes the waiting requests in
arrival order, up to `max_num_seqs` of them, and runs them through the `EncoderRunner`'s
bucketed programs. The runner pools without normalizing; each request's `PoolingParams` then
cut its vector to `dimensions` and normalize it (or not) on the host, so requests that ask
differently share a batch.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

from jaxllm.classifier import ClassifierHead, read_classifier
from jaxllm.config import EngineConfig, resolve_dtype
from jaxllm.engine.core_outputs import FinishReason, RequestUpdate, Stats, StepEvents
from jaxllm.engine.input_processor import InputProcessor
from jaxllm.engine.messages import Ready
from jaxllm.pooling import (
    ENCODER_CLASSIFIER_POOLER,
    PoolerConfig,
    check_params,
    finish_vector,
    read_max_seq_length,
    resolve_pooler_config,
    supported_tasks,
)
from jaxllm.pooling_params import PoolingParams
from jaxllm.worker import EncoderRunner

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Waiting:
    request_id: str
    token_ids: list[int]
    params: PoolingParams
    arrival: float
    token_type_ids: list[int] | None = None


class EncoderEngineCore:
    def __init__(
        self,
        runner: EncoderRunner,
        pooler: PoolerConfig,
        *,
        max_num_seqs: int,
        head: ClassifierHead | None = None,
    ):
        """`runner` pools without normalizing (`pooler` says what normalizing means here);
        `head`: a classifier's, applied to each pooled vector."""
        self.runner = runner
        self.pooler = pooler
        self.head = head
        # The front end's checks, applied again to what the core is handed (as EngineCore's).
        self.input_processor = InputProcessor(
            None,
            eos_token_ids=(),
            vocab_size=runner.config.vocab_size,
            max_model_len=runner.max_model_len,
        )
        self.max_num_seqs = max_num_seqs
        self.waiting: collections.OrderedDict[str, _Waiting] = collections.OrderedDict()
        self.running: list[str] = []  # the step in progress, for CoreLoop's failure path
        self.num_steps = 0
        self.num_tokens = 0
        self.last_step = StepEvents()
        self.config: EngineConfig | None = None
        self.warmup_seconds: float | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> EncoderEngineCore:
        """Loads the encoder and its pooling (from the checkpoint), and compiles every
        program (unless `skip_warmup`). `max_model_len` defaults to the checkpoint's
        sentence-transformers `max_seq_length`, else to the encoder's positions."""
        from jaxllm.loaders.encoder import load_encoder
        from jaxllm.model_files import resolve_model

        path = resolve_model(config.load.model)
        if config.parallel.tensor_parallel_size not in (None, 1) or config.parallel.multihost:
            raise ValueError(
                "a pooling model runs on one device: tensor_parallel_size and multi-host "
                "serving are for generative models"
            )
        encoder = load_encoder(path, dtype=resolve_dtype(config.load.dtype))
        if config.load.runner == "generate":
            raise ValueError(
                f"runner generate: {encoder.config.architecture} is an encoder, it does not "
                "generate (serve it with --runner auto or pooling)"
            )
        head = read_classifier(path)
        default = ENCODER_CLASSIFIER_POOLER if head is not None else None
        pooler = resolve_pooler_config(path, config.load.pooler_config, default)
        sched = config.scheduler
        max_model_len = sched.max_model_len or read_max_seq_length(path) or encoder.config.max_len
        runner = EncoderRunner(
            encoder,
            dataclasses.replace(pooler, normalize=False),
            max_model_len=max_model_len,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
        )
        core = cls(runner, pooler, max_num_seqs=sched.max_num_seqs, head=head)
        core.config = config.replace(max_model_len=max_model_len)
        logger.info(
            "pooling model %s (%s pooling%s): buckets %s, %d programs",
            encoder.config.architecture,
            pooler.pooling_type,
            ", normalized" if pooler.normalize else "",
            runner.buckets.shapes,
            runner.num_programs,
        )
        if not config.compilation.skip_warmup:
            core.warmup_seconds = runner.warmup()
            logger.info("warmup: %d programs in %.1f s", runner.num_programs, core.warmup_seconds)
        return core

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    is_pooling = True  # it serves pooling requests only
    sleep_level = 0  # sleep mode is the generative engine's
    generation_config: dict = {}  # no sampling defaults: it does not generate

    def sleep(self, level: int = 1) -> None:
        raise ValueError("sleep mode is not supported for an encoder's pooling core")

    def wake_up(self) -> None:
        pass

    @property
    def hidden_size(self) -> int:
        return self.runner.config.hidden_size

    def add_request(self, request) -> None:
        raise ValueError(
            "this is a pooling model (an encoder): it serves embeddings, not generation"
        )

    def add_pooling_request(
        self,
        request_id: str,
        token_ids: list[int],
        params: PoolingParams,
        token_type_ids: list[int] | None = None,
    ) -> None:
        """Queues a request; a ValueError naming the field if it cannot run here (a front end
        checks and truncates first; the core checks again, so a bad request fails alone)."""
        check_params(params, self.hidden_size, self.head)
        self.input_processor.check_pooling_ids(token_ids)
        if token_type_ids is not None:
            types = self.runner.config.type_vocab_size
            if len(token_type_ids) != len(token_ids) or not all(
                0 <= t < types for t in token_type_ids
            ):
                raise ValueError(f"token_type_ids must be one id below {types} per token")
        if request_id in self.waiting:
            raise ValueError(f"request id {request_id!r} is already waiting")
        self.waiting[request_id] = _Waiting(
            request_id, token_ids, params, time.monotonic(), token_type_ids
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.waiting.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def running_request_ids(self) -> list[str]:
        return list(self.running)

    def step(self) -> list[RequestUpdate]:
        """Encodes up to `max_num_seqs` waiting requests, oldest first, and finishes them."""
        start = time.perf_counter()
        self.running = []  # a failed step's requests were reported by CoreLoop
        batch = [
            self.waiting.popitem(last=False)[1]
            for _ in range(min(len(self.waiting), self.max_num_seqs))
        ]
        if not batch:
            self.last_step = StepEvents()
            return []
        self.running = [w.request_id for w in batch]
        now = time.monotonic()
        vectors = self.runner.run([w.token_ids for w in batch], [w.token_type_ids for w in batch])
        self.running = []
        self.num_steps += 1
        self.num_tokens += sum(len(w.token_ids) for w in batch)
        scheduled = [(w.request_id, now - w.arrival, now) for w in batch]
        self.last_step = StepEvents(scheduled, time.perf_counter() - start)
        return [
            RequestUpdate(
                w.request_id,
                [],
                finish_reason=FinishReason.STOP,
                pooled=finish_vector(v, w.params, self.pooler, self.head).tolist(),
            )
            for w, v in zip(batch, vectors, strict=True)
        ]

    def drain(self) -> list[RequestUpdate]:
        return []  # every step is synchronous

    def forget_lost_cache(self) -> None:
        pass  # no cache to lose

    def ready(self) -> Ready:
        """What the front end learns of this engine once it has warmed up (no KV cache)."""
        return Ready(
            max_model_len=self.max_model_len,
            vocab_size=self.runner.config.vocab_size,
            eos_token_ids=[],
            num_pages=0,
            page_size=0,
            num_programs=self.runner.num_programs,
            stats=self.stats(),
            pooling=True,
            hidden_size=self.hidden_size,
            labels=list(self.head.labels) if self.head is not None else [],
            supported_tasks=supported_tasks(self.head),
        )

    def stats(self) -> Stats:
        return Stats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_compilations=self.runner.num_compilations,
            num_steps=self.num_steps,
            num_scheduled_tokens=self.num_tokens,
        )

    def shutdown(self) -> None:
        pass

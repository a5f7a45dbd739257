"""`LLM`: offline batch generation, the same surface as vLLM's `LLM`.

    llm = LLM("smollm2-135m")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

All prompts of one `generate` call go through the front end's input path first
(`InputProcessor`, the server's too: a bad one raises `InputError`, a `ValueError` naming the
parameter, and nothing is queued), then to the engine together, so they share batches:
continuous batching runs them side by side rather than one after another. The engine is driven
by the same `CoreLoop` as the server's core process.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np
from tqdm.auto import tqdm

from jaxllm.config import EngineConfig
from jaxllm.engine.core_proc import CoreLoop, build_engine_core
from jaxllm.engine.input_processor import InputProcessor
from jaxllm.engine.messages import Abort, AddPooling
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.stat_logger import LoggingStatLogger
from jaxllm.errors import InputError
from jaxllm.loaders import load_tokenizer
from jaxllm.lora import LoRARequest
from jaxllm.metrics_reader import Metric, metrics_of
from jaxllm.model_files import resolve_model
from jaxllm.multimodal.chat import split_images
from jaxllm.multimodal.processor import ImageProcessor
from jaxllm.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxllm.pooling import check_params as check_pooling_params
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | dict[str, Any]


class LLM:
    """An engine (`EngineCore`), a tokenizer and an output processor, in this process.

    `LLM(model, **engine_args)`: the keyword arguments are the fields of `EngineConfig`'s
    sections, by name (`max_num_seqs=8`, `tensor_parallel_size=4`, ...), each documented
    where it is declared in `jaxllm.config` and shown by `help(LLM)`; `config=` takes a whole
    `EngineConfig` instead. In a multi-host run (`jax.distributed` initialized first, or
    `distributed=True`) host 0 generates and every other host calls
    `multihost.run_worker(llm.engine.runner, llm.engine.config.parallel)`."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        config: EngineConfig | None = None,
        **engine_args: Any,
    ):
        if config is None:
            if model is None:
                raise TypeError("LLM() needs a model (or a config)")
            # Offline, the periodic stats lines only when asked (vLLM's `LLM` default).
            engine_args.setdefault("disable_log_stats", True)
            config = EngineConfig.create(model, **engine_args)
        elif model is not None or engine_args:
            raise TypeError("LLM(config=...) takes no other engine arguments")
        if config.parallel.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1 is served by `jaxllm serve` (AsyncLLM), which starts "
                "a core per rank; the offline LLM runs one engine core"
            )
        if config.cache.kv_transfer_config is not None:
            raise ValueError(
                "kv_transfer_config (prefill/decode disaggregation) is served by `jaxllm "
                "serve`, whose engine core serves and pulls KV blocks between steps"
            )
        # The tokenizer (mostly importing transformers) loads on a thread meanwhile.
        tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-tokenizer")
        tokenizer = tokenizer_pool.submit(load_tokenizer, config.load.model)
        tokenizer_pool.shutdown(wait=False)
        self.engine = build_engine_core(config)  # a pooling model (an encoder): `embed`
        self.config = self.engine.config
        self.tokenizer = tokenizer.result()[0]
        ready = self.engine.ready()
        self.input_processor = InputProcessor.for_engine(
            self.tokenizer,
            self.generation_config,
            ready,
            seed=self.config.load.seed,
            images=ImageProcessor.for_engine(resolve_model(config.load.model), ready, self.config),
        )
        # The engine is driven as the server's core process drives it (one loop, one way
        # to fail a step), in this thread.
        self.loop = CoreLoop(self.engine)
        # vLLM's periodic log lines (`disable_log_stats=False`), from the steps `_run` drives.
        self._stat_logger = (
            None if self.config.observability.disable_log_stats else LoggingStatLogger()
        )

    # What researchers and tests reach for, all owned by the engine.
    runner = property(lambda self: self.engine.runner)
    kv_cache_manager = property(lambda self: self.engine.scheduler.kv)
    model_config = property(lambda self: self.engine.model_config)
    generation_config = property(lambda self: self.engine.generation_config)
    scheduler_config = property(lambda self: self.config.scheduler)
    mesh = property(lambda self: self.engine.mesh)
    attention_backend = property(lambda self: self.config.compilation.attention_backend)
    warmup_seconds = property(lambda self: self.engine.warmup_seconds)
    eos_token_ids = property(lambda self: self.input_processor.eos_token_ids)

    def sleep(self, level: int = 1) -> None:
        """Frees the device memory of the weights and the KV cache until `wake_up` (vLLM's
        sleep mode): level 1 keeps the weights in host memory, level 2 drops them (waking
        reloads them from the checkpoint). The compiled programs stay: waking compiles
        nothing."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    @property
    def is_sleeping(self) -> bool:
        return bool(self.engine.sleep_level)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False (nothing done) while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges since start, as vLLM's `LLM.get_metrics()`
        returns them (`jaxllm.metrics_reader`: `Counter`, `Gauge`, `Vector`), under the
        server's `/metrics` names: with speculative decoding
        `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and
        the vector `..._num_accepted_tokens_per_pos` (mean acceptance length: 1 + accepted /
        drafts)."""
        spec = self.config.speculative.method
        k = spec.num_speculative_tokens if spec is not None else 0
        return metrics_of(self.engine.stats(), str(self.config.load.model), k)

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    def get_tokenizer(self):
        return self.tokenizer

    # ---- validation -------------------------------------------------------------------

    @property
    def is_pooling_model(self) -> bool:
        return self.engine.is_pooling

    def _normalize(self, prompts, sampling_params) -> tuple[list[Prompt], list[SamplingParams]]:
        if self.is_sleeping:
            raise RuntimeError("the engine is asleep (LLM.sleep): call LLM.wake_up() first")
        if self.is_pooling_model:
            raise InputError(
                "this is a pooling model: it embeds (LLM.embed), it does not generate",
                "model",
            )
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InputError(
                    f"sampling_params: got {len(params)} for {len(prompts)} prompts; pass one "
                    f"SamplingParams or one per prompt",
                    "sampling_params",
                )
        for p in params:
            self.input_processor.check_params(p)
        return prompts, params

    # ---- generation -------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`priority`: one int per prompt, lower first; needs scheduling_policy="priority".
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); needs enable_lora."""
        prompts, params = self._normalize(prompts, sampling_params)
        priorities = self._priorities(priority, len(prompts))
        loras = self._loras(lora_request, len(prompts))
        tokenized = [self.input_processor.prompt_inputs(p) for p in prompts]
        salts = [_cache_salt(p) for p in prompts]
        return self._run(
            tokenized, params, use_tqdm=use_tqdm, priorities=priorities, loras=loras, salts=salts
        )

    @staticmethod
    def _loras(lora_request, n: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        loras = list(lora_request)
        if len(loras) != n or not all(r is None or isinstance(r, LoRARequest) for r in loras):
            raise InputError(
                f"lora_request must be a LoRARequest or a list of {n} (one per prompt)",
                "lora_request",
            )
        return loras

    def _priorities(self, priority: Sequence[int] | None, n: int) -> list[int] | None:
        if priority is None:
            return None  # everyone at the default priority (see _run)
        if self.scheduler_config.scheduling_policy != "priority":
            raise InputError(
                'priority: requires LLM(..., scheduling_policy="priority")', "priority"
            )
        priority = list(priority)
        if len(priority) != n or not all(
            isinstance(p, int) and not isinstance(p, bool) for p in priority
        ):
            raise InputError(f"priority must be {n} integers, one per prompt", "priority")
        return priority

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of them (OpenAI-style messages;
        an image-text model's may hold `image_url` parts, and `image_pil` parts with a PIL
        image)."""
        if self.tokenizer is None:
            raise InputError("messages: this model has no tokenizer or chat template", "messages")
        if not isinstance(messages, list) or not messages:
            raise InputError("messages must be a non-empty list", "messages")
        conversations = messages if isinstance(messages[0], list) else [messages]
        texts, images = [], []
        for conv in conversations:
            if not conv or not all(isinstance(m, dict) and "role" in m for m in conv):
                raise InputError("messages: each message must be a dict with a 'role'", "messages")
            conv, sources = split_images(conv)
            if sources and self.input_processor.images is None:
                raise InputError("messages: this model takes no images", sources[0][1])
            images.append(self.input_processor.images.load(sources, "messages") if sources else [])
            texts.append(
                self.tokenizer.apply_chat_template(
                    conv,
                    chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=False,
                    **(chat_template_kwargs or {}),
                )
            )
        prompts, params = self._normalize(texts, sampling_params)
        # The template already holds any BOS token, so none is added when tokenizing.
        tokenized = [
            self.input_processor.prompt_inputs(p, i, add_special_tokens=False)
            for p, i in zip(prompts, images, strict=True)
        ]
        loras = self._loras(lora_request, len(prompts))
        return self._run(tokenized, params, use_tqdm=use_tqdm, loras=loras)

    # ---- pooling ----------------------------------------------------------------------

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (a string, or a dict with `prompt_token_ids`), as vLLM's
        `LLM.embed`: pooled as the checkpoint says, then cut to `dimensions` and normalized as
        each `PoolingParams` asks. `truncate_prompt_tokens` keeps a prompt's last k tokens
        (-1: the last max_model_len); without it a longer prompt is refused."""
        texts, requests = self._pooling_requests(
            "embed", prompts, pooling_params, truncate_prompt_tokens
        )
        vectors = self._pool(requests, use_tqdm, "Embedding")
        return [
            EmbeddingRequestOutput(
                r.request_id, EmbeddingOutput(v), r.prompt_token_ids, prompt=text
            )
            for text, r, v in zip(texts, requests, vectors, strict=True)
        ]

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities, from a sequence classification model, as vLLM's
        `LLM.classify` (`PoolingParams(activation=False)`: the logits)."""
        texts, requests = self._pooling_requests(
            "classify", prompts, pooling_params, truncate_prompt_tokens
        )
        outputs = self._pool(requests, use_tqdm, "Classifying")
        return [
            ClassificationRequestOutput(
                r.request_id, ClassificationOutput(v), r.prompt_token_ids, prompt=text
            )
            for text, r, v in zip(texts, requests, outputs, strict=True)
        ]

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's pooled output as the model makes it, as vLLM's `LLM.encode`."""
        texts, requests = self._pooling_requests(
            "encode", prompts, pooling_params, truncate_prompt_tokens
        )
        outputs = self._pool(requests, use_tqdm, "Pooling")
        return [
            PoolingRequestOutput(r.request_id, PoolingOutput(v), r.prompt_token_ids, prompt=text)
            for text, r, v in zip(texts, requests, outputs, strict=True)
        ]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """The score of each pair, as vLLM's `LLM.score`: one `data_1` against every
        `data_2`, or as many of each, one to one. A cross-encoder (a classifier with one
        label) reads each pair together and gives its relevance; an embedding model gives the
        cosine similarity of the two texts' embeddings."""
        self._require("score")
        firsts, seconds = _texts(data_1, "data_1"), _texts(data_2, "data_2")
        if len(firsts) not in (1, len(seconds)):
            raise InputError(
                f"data_2 has {len(seconds)} texts for data_1's {len(firsts)}: give one data_1, "
                "or as many as data_2",
                "data_2",
            )
        pairs = list(
            zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds, strict=True)
        )
        if "classify" in self.supported_tasks:  # a cross-encoder
            params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
            requests = []
            for a, b in pairs:
                ids, types = self.input_processor.pair_prompt(
                    a, b, truncate_prompt_tokens, param="data_2"
                )
                rid = self.input_processor.next_request_id()
                requests.append(AddPooling(rid, ids, params, types))
            scores = [v[0] for v in self._pool(requests, use_tqdm, "Scoring")]
            return [
                ScoringRequestOutput(r.request_id, ScoringOutput(s), r.prompt_token_ids)
                for r, s in zip(requests, scores, strict=True)
            ]
        distinct = list(dict.fromkeys(firsts + seconds))
        params = PoolingParams(normalize=True, truncate_prompt_tokens=truncate_prompt_tokens)
        _, requests = self._pooling_requests("score", distinct, params, None)
        vectors = dict(zip(distinct, self._pool(requests, use_tqdm, "Scoring"), strict=True))
        ids = {t: r.prompt_token_ids for t, r in zip(distinct, requests, strict=True)}
        return [
            ScoringRequestOutput(
                self.input_processor.next_request_id(),
                ScoringOutput(float(np.dot(vectors[a], vectors[b]))),
                ids[b],
            )
            for a, b in pairs
        ]

    @property
    def supported_tasks(self) -> list[str]:
        """What the model serves, by vLLM's task names (see `jaxllm.pooling.supported_tasks`)."""
        return self.engine.ready().supported_tasks

    def _require(self, task: str) -> None:
        if task not in self.supported_tasks:
            kind = "a pooling model" if self.is_pooling_model else "a generative model"
            raise InputError(
                f"this is {kind}: it serves {', '.join(self.supported_tasks)}, not {task!r}"
                + ("" if self.is_pooling_model else " (serve a pooling model, or --runner)"),
                "model",
            )

    def _pooling_requests(
        self, task: str, prompts, pooling_params, truncate_prompt_tokens
    ) -> tuple[list[str | None], list[AddPooling]]:
        """Each prompt's text and checked request, for `task`."""
        self._require(task)
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise InputError(
                "prompts must be a string, a dict with 'prompt_token_ids', or a list of them; "
                f"got {type(prompts).__name__}",
                "prompt",
            )
        prompts = list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise InputError(
                    f"pooling_params: got {len(params)} for {len(prompts)} prompts; pass one "
                    "PoolingParams or one per prompt",
                    "pooling_params",
                )
        if truncate_prompt_tokens is not None:
            params = [msgspec.structs.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                      for p in params]  # fmt: skip
        texts, requests = [], []
        for prompt, p in zip(prompts, params, strict=True):
            if not isinstance(p, PoolingParams):
                raise InputError(
                    f"pooling_params must be PoolingParams, got {type(p).__name__}",
                    "pooling_params",
                )
            try:
                check_pooling_params(p, self.engine.hidden_size, self.engine.head)
            except ValueError as e:
                raise InputError(str(e), "pooling_params") from None
            text, ids = self.input_processor.pooling_prompt(prompt, p.truncate_prompt_tokens)
            texts.append(text)
            requests.append(AddPooling(self.input_processor.next_request_id(), ids, p))
        return texts, requests

    def _pool(self, requests: list[AddPooling], use_tqdm: bool, desc: str) -> list[list[float]]:
        """Runs pooling requests to their outputs, in their order."""
        outputs: dict[str, list[float]] = {}
        bar = tqdm(total=len(requests), desc=desc, disable=not use_tqdm, unit="prompt")
        try:
            for r in requests:
                self.loop.handle(r)
            while len(outputs) < len(requests):
                out = self.loop.step()
                if self.loop.step_error is not None:
                    raise self.loop.step_error
                for u in out.updates:
                    if u.pooled is None:
                        raise RuntimeError(f"request {u.request_id} failed ({u.finish_reason})")
                    outputs[u.request_id] = u.pooled
                    bar.update(1)
                if len(outputs) < len(requests) and not self.engine.has_unfinished_requests():
                    raise RuntimeError("engine went idle with requests unfinished")
        finally:
            bar.close()
            self.loop.settle(abort=[r.request_id for r in requests if r.request_id not in outputs])
        return [outputs[r.request_id] for r in requests]

    def _run(
        self,
        tokenized,
        params: list[SamplingParams],
        *,
        use_tqdm: bool,
        priorities: list[int] | None = None,
        loras: list[LoRARequest | None] | None = None,
        salts: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        output_processor = OutputProcessor(self.tokenizer)
        groups: list[tuple[str, str | None, list[int], list[str]]] = []
        children: dict[str, int] = {}  # engine request id -> index into groups
        requests = []
        priorities = priorities or [0] * len(params)
        loras = loras or [None] * len(params)
        salts = salts or [None] * len(params)
        for (text, ids, items), sp, prio, lora, salt in zip(
            tokenized, params, priorities, loras, salts, strict=True
        ):
            rid = self.input_processor.next_request_id()
            subs = self.input_processor.fan_out(
                rid, ids, sp, priority=prio, lora_request=lora, mm_items=items, cache_salt=salt
            )
            for i, request in subs:
                output_processor.add_request(request.request_id, i, ids, sp)
                children[request.request_id] = len(groups)
                requests.append(request)
            groups.append((rid, text, ids, [r.request_id for _, r in subs]))

        pending = {r.request_id for r in requests}
        unstarted = {r.request_id: len(r.prompt_token_ids) for r in requests}  # (stats lines)
        remaining = [len(g[3]) for g in groups]
        bar = tqdm(total=len(groups), desc="Generating", disable=not use_tqdm, unit="prompt")
        try:
            for r in requests:
                self.loop.handle(r)
            while pending:
                out = self.loop.step()
                if self.loop.step_error is not None:
                    # The loop failed the step's requests, as the server's core does; a
                    # batch call has no one to hand the rest to, so it ends with the error.
                    raise self.loop.step_error
                finished, to_abort = output_processor.process(out.updates)
                if to_abort:  # stop strings: the core must stop generating them
                    self.loop.handle(Abort(to_abort))
                if self._stat_logger is not None:
                    started = [u for u in out.updates if u.new_token_ids]
                    self._stat_logger.record(
                        out.stats,
                        sum(unstarted.pop(u.request_id, 0) for u in started),
                        sum(len(u.new_token_ids) for u in started),
                    )
                    self._stat_logger.maybe_log()
                for rid in finished:
                    pending.discard(rid)
                    remaining[children[rid]] -= 1
                    if remaining[children[rid]] == 0:
                        bar.update(1)
                if pending and not self.engine.has_unfinished_requests():
                    raise RuntimeError(
                        f"engine went idle with {len(pending)} request(s) unfinished"
                    )
        finally:
            bar.close()
            # On any error, leave the engine clean for the next call.
            self.loop.settle(abort=sorted(pending))
        return [
            RequestOutput(
                request_id=rid,
                prompt=text,
                prompt_token_ids=ids,
                outputs=[output_processor.output(s) for s in sub_ids],
                finished=True,
                prompt_logprobs=output_processor.prompt_logprobs(sub_ids[0]),
            )
            for rid, text, ids, sub_ids in groups
        ]


def _texts(data: str | Sequence[str], param: str) -> list[str]:
    if isinstance(data, str):
        data = [data]
    if not isinstance(data, Sequence) or not data or not all(isinstance(t, str) for t in data):
        raise InputError(f"{param} must be a string or a non-empty list of strings", param)
    return list(data)


def _signature() -> inspect.Signature:
    """`LLM.__init__`'s signature with every engine field spelled out, defaults as declared
    (for `help(LLM)`, IDEs and `inspect`)."""
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_OR_KEYWORD), P("model", P.POSITIONAL_OR_KEYWORD)]
    for name, (_, f) in EngineConfig.fields().items():
        if name != "model":
            params.append(P(name, P.KEYWORD_ONLY, default=f.default))
    params.append(P("config", P.KEYWORD_ONLY, default=None))
    return inspect.Signature(params)


LLM.__init__.__signature__ = _signature()


def _cache_salt(prompt) -> str | None:
    """A prompt dict's `cache_salt` (vLLM's): only prompts of one salt share cached
    prefixes."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InputError("cache_salt must be a non-empty string", "cache_salt")
    return salt

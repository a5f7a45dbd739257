"""`LLM`: offline batch generation, the same surface as vLLM's `LLM`.

    llm = LLM("smollm2-135m")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

All prompts of one `generate` call are validated first (a bad one raises `ValueError` naming
the parameter and nothing is queued), then added to the engine together, so they share
batches: continuous batching runs them side by side rather than one after another.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

import pallas_kernels
from jaxllm.compilation_cache import setup_compilation_cache
from jaxllm.config import CacheConfig, SchedulerConfig, resolve_dtype
from jaxllm.engine.core import EngineCore
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.request import Request, check_prompt_ids, derive_seed, resolve_max_tokens
from jaxllm.engine.scheduler import Scheduler
from jaxllm.kv_sizing import plan_kv_cache
from jaxllm.loaders import load_model, load_tokenizer
from jaxllm.model_cache import cache_dir
from jaxllm.outputs import RequestOutput
from jaxllm.runner import ModelRunner
from jaxllm.sampling_params import SamplingParams
from jaxllm.sharding import make_mesh

logger = logging.getLogger(__name__)

Prompt = str | dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str | os.PathLike,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        memory_utilization: float = 0.9,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        seed: int = 0,
        attention_backend: str = "auto",
        enable_prefix_caching: bool = True,
        scheduling_policy: str = "fcfs",
        skip_warmup: bool = False,
        compilation_cache_dir: str | os.PathLike | None = "default",
        tensor_parallel_size: int = 1,
        async_scheduling: bool = True,
    ):
        """`compilation_cache_dir`: JAX's persistent compilation cache; "default" is
        `<cache>/xla` under `$JAXLLM_CACHE_DIR` or `~/.cache/jaxllm`, None leaves JAX's
        setting alone. `skip_warmup` skips compiling every bucket at startup (programs then
        compile on first use). `tensor_parallel_size`: split the model and its KV cache over
        this many devices (see `jaxllm.sharding`). `async_scheduling`: schedule
        each step while the previous one runs (see `jaxllm.engine.core`)."""
        if compilation_cache_dir == "default":
            compilation_cache_dir = cache_dir() / "xla"
        setup_compilation_cache(compilation_cache_dir)
        jdtype = resolve_dtype(dtype)
        self.attention_backend = backend = pallas_kernels.resolve_backend(attention_backend)
        cache_config = CacheConfig(
            page_size=page_size, num_pages=num_pages, memory_utilization=memory_utilization
        )
        self.mesh = make_mesh(tensor_parallel_size) if tensor_parallel_size != 1 else None
        # The tokenizer (mostly importing transformers) loads on a thread meanwhile.
        tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-tokenizer")
        tokenizer = tokenizer_pool.submit(load_tokenizer, model)
        tokenizer_pool.shutdown(wait=False)
        loaded = load_model(
            model, dtype=jdtype, attention_backend=backend, mesh=self.mesh, load_tokenizer=False
        )
        self.model_config = loaded.config
        self.generation_config = loaded.generation_config
        # On the CPU the KV cache stays float32 under bfloat16 weights: XLA's CPU backend
        # computes bfloat16 in float32, and converting the cache for the K/V write made every
        # forward program copy it, every step (found by the runner's in-place check).
        kv_dtype = jnp.float32 if jax.default_backend() == "cpu" else jdtype
        num_pages, max_model_len = plan_kv_cache(
            loaded.config, cache_config, kv_dtype, max_model_len, tensor_parallel_size
        )
        self.scheduler_config = SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            policy=scheduling_policy,
        )
        self.runner = ModelRunner(
            loaded.model,
            loaded.config,
            num_pages=num_pages,
            page_size=page_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            dtype=kv_dtype,
            mesh=self.mesh,
        )
        self.kv_cache_manager = KVCacheManager(
            num_pages, page_size, enable_prefix_caching=enable_prefix_caching
        )
        self.engine = EngineCore(
            Scheduler(self.scheduler_config, self.kv_cache_manager),
            self.runner,
            async_scheduling=async_scheduling,
        )
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()
        logger.info(
            "buckets: tokens %s x requests %s; programs: %d forward shapes %s + %d output "
            "heads + %d prompt scorers = %d",
            self.runner.token_buckets,
            self.runner.request_buckets,
            len(self.runner.shapes),
            self.runner.shapes,
            len(self.runner.request_buckets),
            len(self.runner.token_buckets),
            self.runner.num_programs,
        )
        self.warmup_seconds = None
        if not skip_warmup:
            self.warmup_seconds = self.runner.warmup()
            logger.info(
                "warmup: %d programs in %.1f s", self.runner.num_programs, self.warmup_seconds
            )
        self.tokenizer = tokenizer.result()[0]
        self.eos_token_ids = self._eos_token_ids()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False (nothing done) while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    def get_tokenizer(self):
        return self.tokenizer

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        gen_eos = self.generation_config.get("eos_token_id")
        ids.update(
            gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        )
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # ---- validation -------------------------------------------------------------------

    def _tokenize(
        self, prompt: Prompt, *, add_special_tokens: bool = True
    ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            text = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
            if not isinstance(ids, list | tuple) or not all(
                isinstance(t, int | np.integer) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError("prompt_token_ids must be a list of integers")
            ids = [int(t) for t in ids]
        else:
            raise ValueError(
                "prompt must be a string or a dict with 'prompt_token_ids', got "
                f"{type(prompt).__name__}"
            )
        check_prompt_ids(
            ids, vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len
        )
        return text, ids

    def _normalize(self, prompts, sampling_params) -> tuple[list[Prompt], list[SamplingParams]]:
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
                raise ValueError(
                    f"sampling_params: got {len(params)} for {len(prompts)} prompts; pass one "
                    f"SamplingParams or one per prompt"
                )
        vocab = self.model_config.vocab_size
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
            bad = [t for t in p.logit_bias or {} if t >= vocab]
            if bad:
                raise ValueError(
                    f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})"
                )
        return prompts, params

    # ---- generation -------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """`priority`: one int per prompt, lower first; needs scheduling_policy="priority"."""
        prompts, params = self._normalize(prompts, sampling_params)
        priorities = self._priorities(priority, len(prompts))
        tokenized = [self._tokenize(p) for p in prompts]
        return self._run(tokenized, params, use_tqdm=use_tqdm, priorities=priorities)

    def _priorities(self, priority: Sequence[int] | None, n: int) -> list[int] | None:
        if priority is None:
            return None  # everyone at the default priority (see _run)
        if self.scheduler_config.policy != "priority":
            raise ValueError('priority: requires LLM(..., scheduling_policy="priority")')
        priority = list(priority)
        if len(priority) != n or not all(
            isinstance(p, int) and not isinstance(p, bool) for p in priority
        ):
            raise ValueError(f"priority must be {n} integers, one per prompt")
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
    ) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of them (OpenAI-style messages)."""
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer or chat template")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        conversations = messages if isinstance(messages[0], list) else [messages]
        texts = []
        for conv in conversations:
            if not conv or not all(isinstance(m, dict) and "role" in m for m in conv):
                raise ValueError("messages: each message must be a dict with a 'role'")
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
        tokenized = [self._tokenize(p, add_special_tokens=False) for p in prompts]
        return self._run(tokenized, params, use_tqdm=use_tqdm)

    def _run(
        self,
        tokenized,
        params: list[SamplingParams],
        *,
        use_tqdm: bool,
        priorities: list[int] | None = None,
    ) -> list[RequestOutput]:
        processor = OutputProcessor(self.tokenizer)
        groups: list[tuple[str, str | None, list[int], list[str]]] = []
        children: dict[str, int] = {}  # sub-request id -> index into groups
        requests = []
        priorities = priorities or [0] * len(params)
        for (text, ids), sp, prio in zip(tokenized, params, priorities, strict=True):
            rid = str(next(self._ids))
            max_tokens = resolve_max_tokens(sp, len(ids), self.max_model_len)
            sub_ids = []
            for i in range(sp.n):
                sub = rid if sp.n == 1 else f"{rid}-{i}"
                requests.append(
                    Request(
                        sub,
                        ids,
                        sp,
                        eos_token_ids=self.eos_token_ids,
                        max_tokens=max_tokens,
                        seed=derive_seed(sp.seed, i, self._rng),
                        priority=prio,
                        prefix_parent=sub_ids[0] if sub_ids else None,
                    )
                )
                processor.add_request(sub, i, ids, sp)
                children[sub] = len(groups)
                sub_ids.append(sub)
            groups.append((rid, text, ids, sub_ids))

        pending = {r.request_id for r in requests}
        remaining = [len(g[3]) for g in groups]
        bar = tqdm(total=len(groups), desc="Generating", disable=not use_tqdm, unit="prompt")
        try:
            for r in requests:
                self.engine.add_request(r)
            while pending:
                finished, to_abort = processor.process(self.engine.step())
                if to_abort:
                    self.engine.abort_requests(to_abort)
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
            if pending:
                self.engine.abort_requests(sorted(pending))
            self.engine.drain()  # a step launched past the last stop: nothing of ours left
            self.engine.forget_lost_cache()
        return [
            RequestOutput(
                request_id=rid,
                prompt=text,
                prompt_token_ids=ids,
                outputs=[processor.output(s) for s in sub_ids],
                finished=True,
                prompt_logprobs=processor.prompt_logprobs(sub_ids[0]),
            )
            for rid, text, ids, sub_ids in groups
        ]

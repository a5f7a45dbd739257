"""How the model is served: `EngineConfig`, one small frozen section per concern, each
validated on construction: `LoadConfig` (the model source and how its weights load),
`CacheConfig`, `SchedulerConfig`, `ParallelConfig`, `CompilationConfig`
(`jaxllm.config.kernels`), `SpeculativeConfig`, `LoRAConfig`, `MultiModalConfig` and
`ObservabilityConfig`.

Every field of a section is declared once, with its default and a docstring: it is an
`LLM(...)` keyword argument (`EngineConfig.create`) and a flag of `jaxllm generate`, `jaxllm
serve`, `jaxllm compile` and the benchmarks (`add_cli_args`: its name with dashes, vLLM's
spelling as an alias where vLLM has the concept, the docstring as its help; the machinery is
`jaxllm.config.flags`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any

from jaxllm.config.flags import (
    add_dataclass_args,
    check_types,
    field_docs,
    option,
    parse_json_field,
    type_hints,
)
from jaxllm.config.kernels import CompilationConfig
from jaxllm.config.kv_events import KVEventsConfig
from jaxllm.config.kv_transfer import DEFAULT_HOST_TIER_GIB, KVTransferConfig

_DTYPES = {
    "float32": "float32",
    "f32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "f16": "float16",
}


def resolve_dtype(dtype: Any, platform: str | None = None):
    """Maps "auto", a name such as "bfloat16", or a dtype to a jnp dtype.

    "auto" is float32 on CPU (exact parity with references) and bfloat16 on accelerators;
    `platform` (default: JAX's default backend) is the one the engine runs on.
    """
    import jax
    import jax.numpy as jnp

    if dtype is None or dtype == "auto":
        cpu = (platform or jax.default_backend()) == "cpu"
        return jnp.dtype(jnp.float32 if cpu else jnp.bfloat16)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
        return jnp.dtype(_DTYPES[dtype])
    return jnp.dtype(dtype)


# `jaxllm.loaders` checks a model's `quantization` against these (`jaxllm.quantization`'s
# docstring says what each means).
QUANTIZATIONS = (
    "int8",
    "int4",
    "fp8",
    "gguf",
    "gptq",
    "awq",
    "compressed-tensors",
    "mxfp4",
    "float",
)
# The KV cache's formats: the float dtypes, and pallas_kernels.QUANTIZED_KV_DTYPES (plus vLLM's
# alias fp8_e4m3), checked against it by the same test.
QUANTIZED_KV_CACHE_DTYPES = ("int8", "fp8")
KV_CACHE_DTYPES = ("auto", *_DTYPES, *QUANTIZED_KV_CACHE_DTYPES, "fp8_e4m3")


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """Where the model comes from, and how its weights are loaded."""

    model: str
    """HF checkpoint directory, .gguf file, orbax checkpoint (`jaxllm convert`), or a demo
    model's name (smollm2-135m)."""
    dtype: str = option("auto", choices=("auto", *_DTYPES))
    """The weights' dtype: auto is float32 on CPU (exact parity with references), bfloat16
    on accelerators."""
    seed: int = 0
    """Seeds the seeds of requests that give none, so a run repeats."""
    quantization: str | None = option(None, "-q", choices=QUANTIZATIONS)
    """Weight quantization: int8 (per channel), int4 (groups of 32, with offsets) or fp8
    (e4m3, per channel) quantize the linear layers (not the experts) and the embedding at
    load; gguf keeps a GGUF file's quantized tensors as they are, as none does on
    accelerators and on CPUs where the native kernel has an integer path (8-bit dot products
    or AVX2; on other CPUs none dequantizes them); gptq, awq and compressed-tensors keep a
    checkpoint quantized by that method (as none does); mxfp4 keeps gpt-oss's MXFP4 experts
    4-bit, dequantized inside the step (as none does on accelerators; on the CPU none
    dequantizes them at load); float dequantizes a GGUF file's tensors and MXFP4 experts at
    load (see jaxllm/quantization.py)."""
    load_format: str = option("auto", choices=("auto", "dummy"))
    """auto reads the weights from the model; dummy makes random ones in its shapes (a
    directory with config.json alone will do), to measure speed and memory without a
    checkpoint: the tokens mean nothing."""
    runner: str = option("auto", choices=("auto", "generate", "pooling"))
    """What the model serves (vLLM's --runner): generate (completions) or pooling (its pooled
    hidden states: embeddings, scores). auto: pooling for an encoder (BERT), and for a
    decoder whose sentence-transformers files pool it (Qwen3-Embedding); generate otherwise."""
    pooler_config: str | None = None
    """JSON over the checkpoint's pooling, vLLM's keys: {"pooling_type": "MEAN", "CLS" or
    "LAST", "normalize": true or false} (a decoder served with --runner pooling and no
    sentence-transformers files pools its last token, normalized)."""

    def __post_init__(self) -> None:
        if hasattr(self.model, "__fspath__"):  # a Path is welcome
            object.__setattr__(self, "model", str(self.model))
        check_types(self)
        if not str(self.model):
            raise ValueError("model must not be empty")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    page_size: int = option(16, "--block-size")
    """Tokens per KV page (vLLM's block size); a power of two."""
    num_pages: int | None = option(None, "--num-gpu-blocks-override")
    """Pages in the KV pool; default: as many as `memory_utilization` leaves room for."""
    memory_utilization: float = option(0.9, "--gpu-memory-utilization")
    """Share of device memory the engine may use (weights, KV cache, temporaries). On a GPU
    it is vLLM's gpu_memory_utilization: a share of the whole device, to which JAX's memory
    pool is set (`jaxllm.worker.kv_sizing`). On CPU, where JAX reports no memory limit, the KV cache
    gets `cpu_kv_cache_gib` instead."""
    cpu_kv_cache_gib: float = 1.0
    """The KV cache's size on CPU, in GiB."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes."""
    kv_cache_dtype: str = option("auto", choices=KV_CACHE_DTYPES)
    """The KV cache's format: auto is the model's dtype (float32 on CPU); int8 and fp8 (e4m3,
    alias fp8_e4m3) store 8 bits per value with a float32 scale per token and head, for
    about 2x the pages of bfloat16 (4x float32) in the same memory."""
    kv_offloading_size: float = 0.0
    """GiB of host memory for a second tier of the prefix cache (vLLM's flag): full blocks
    evicted from the device pool are copied there and copied back when a prompt's prefix
    hits them, instead of being recomputed; 0: off. Needs prefix caching."""
    disable_hybrid_kv_cache_manager: bool = False
    """Keep every token of every layer, sliding-window layers included (vLLM's flag). By
    default a model that mixes sliding-window and full-attention layers (Gemma 2/3) keeps
    only the window's blocks in its sliding layers, for more sequences in the same memory
    (see `jaxllm.worker.kv_groups`)."""
    mamba_cache_mode: str = option("align", choices=("align", "none"))
    """Prefix caching for a hybrid model's linear-attention layers (vLLM's flag), whose state
    is one matrix per request, not pages: align saves a request's state where a step's chunk
    ends at a page boundary (prompts are chunked to end on one), and a cached prefix is
    served only up to a boundary whose state was saved (`jaxllm.engine.state_snapshots`);
    none turns prefix caching off for such models (prefixes are recomputed)."""
    num_state_snapshots: int | None = None
    """Saved states a hybrid model's prefix cache keeps (each one request's state of every
    linear layer); default: max_num_seqs, or what a quarter of the memory left for the cache
    holds, if less. 0 turns prefix caching off for such models."""
    prefix_caching_hash_algo: str = option("sha256", choices=("sha256", "sha256_cbor"))
    """How full blocks are hashed for prefix caching, as vLLM hashes them
    (`jaxllm.engine.block_hashing`): sha256 over the pickled (parent, tokens, extra keys)
    tuple, vLLM's default; sha256_cbor over its canonical CBOR, which an indexer written in
    another language can recompute (llm-d's). The seed is PYTHONHASHSEED, as vLLM's."""
    kv_events_config: dict | None = None
    """vLLM's JSON: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
    "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "...", "buffer_steps": n} publishes
    the prefix cache's changes (blocks stored and removed, resets) in vLLM's format over
    ZeroMQ, for prefix-aware routers (`jaxllm.engine.kv_events`); "encoding": "map" writes
    each event as a map (vLLM since mid-2026) instead of an array (vLLM's example subscriber)."""
    kv_transfer_config: dict | None = None
    """vLLM's JSON for prefill/decode disaggregation: {"kv_connector": "JaxTransferConnector"
    (or vLLM's "NixlConnector", served the same way), "kv_role": "kv_producer" | "kv_consumer"
    | "kv_both", "kv_ip": ..., "kv_port": ...}. A producer keeps a request sent with
    kv_transfer_params {"do_remote_decode": true} in its KV cache once prefilled and answers
    with the params a decoder needs; a consumer given them pulls those blocks instead of
    computing the prompt (`jaxllm.engine.kv_transfer`). Pulled blocks land in the host KV
    tier, which a role gets by default (2 GiB unless kv_offloading_size sets it)."""

    def __post_init__(self) -> None:
        parse_json_field(self, "kv_events_config")
        parse_json_field(self, "kv_transfer_config")
        check_types(self)
        KVEventsConfig.parse(self.kv_events_config)  # a bad field raises, named
        transfer = KVTransferConfig.parse(self.kv_transfer_config)
        if transfer is not None and not self.enable_prefix_caching:
            raise ValueError("kv_transfer_config needs prefix caching (enable_prefix_caching): pulled blocks are found as cached prefixes")  # fmt: skip
        if self.num_state_snapshots is not None and self.num_state_snapshots < 0:
            raise ValueError(f"num_state_snapshots must be >= 0, got {self.num_state_snapshots}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if not self.cpu_kv_cache_gib > 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        if not self.kv_offloading_size >= 0:
            raise ValueError(f"kv_offloading_size must be >= 0, got {self.kv_offloading_size}")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size needs prefix caching (enable_prefix_caching)")

    @property
    def host_tier_gib(self) -> float:
        """The host KV tier's size: kv_offloading_size, or a KV transfer role's default."""
        if self.kv_offloading_size or self.kv_transfer_config is None:
            return self.kv_offloading_size
        return DEFAULT_HOST_TIER_GIB


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching."""

    max_model_len: int | None = None
    """Longest sequence (prompt + output) a request may reach; default: the model's context,
    clipped to what the KV cache holds. The engine fills it in when it starts."""
    max_num_seqs: int = 64
    """Most requests in one step."""
    max_num_batched_tokens: int = 512
    """Most tokens (prefill chunks + decodes) in one step."""
    scheduling_policy: str = option("fcfs", choices=("fcfs", "priority"))
    """fcfs: waiting requests in arrival order, the newest running one is preempted first.
    priority: by (priority, arrival), lower values first; the lowest-priority, newest running
    request is preempted first, and a waiting request may preempt lower-priority ones."""
    async_scheduling: bool = True
    """Schedule each step while the previous one runs on the device."""

    def __post_init__(self) -> None:
        check_types(self)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): every running request needs a token"
            )


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Devices, and hosts (see `jaxllm.engine.multihost`)."""

    tensor_parallel_size: int | None = None
    """Split the model and its KV cache over this many devices; default: 1 on one host,
    every device of every host in a multi-host run."""
    distributed: bool = False
    """Join a multi-host run (`jax.distributed`): host 0 schedules (and serves HTTP), the
    others execute its steps. Implied by `coordinator_address`; on Cloud TPU VMs JAX
    discovers the coordinator, the process count and this host's id."""
    coordinator_address: str | None = None
    """host:port of process 0's coordinator (env JAXLLM_COORDINATOR_ADDRESS)."""
    num_processes: int | None = None
    """Processes (hosts) in the run (env JAXLLM_NUM_PROCESSES)."""
    process_id: int | None = None
    """This process's index, 0 on the host that schedules (env JAXLLM_PROCESS_ID)."""
    lockstep_address: str | None = None
    """tcp://HOST0:PORT of the channel host 0 sends its steps on (env
    JAXLLM_LOCKSTEP_ADDRESS); default: the coordinator's host, one port above it."""
    data_parallel_size: int = option(1, "-dp")
    """Engine cores behind one API server (vLLM's flag), each with its own devices
    (`tensor_parallel_size` of them: a GPU slice, one TPU chip, or its share of the CPU
    cores) and its own KV cache; requests go to the least loaded (`jaxllm.engine.dp_client`).
    Served by `jaxllm serve`; the offline `LLM` runs one core."""
    data_parallel_rank: int = 0
    """This engine core's rank among `data_parallel_size` (set by the API server for each
    core it starts)."""
    data_parallel_size_local: int | None = None
    """Engine cores on this host (vLLM's flag); default: all `data_parallel_size`. The API
    server's host runs ranks [0, this); the others run on other hosts, started there by
    `jaxllm serve --headless`, and connect to the API server at `data_parallel_address`."""
    data_parallel_start_rank: int = 0
    """The first rank this host runs: 0 on the API server's host; a headless host's first."""
    data_parallel_address: str = "127.0.0.1"
    """The API server's host address, which other hosts' engine cores connect to (vLLM's
    flag). The API server listens for them on it (on every interface if it is no IP of its
    host's)."""
    data_parallel_rpc_port: int = 29550
    """The first of the API server's ports for other hosts' engine cores (vLLM's flag):
    rank r's requests go out on this + 2r, its outputs come back on this + 2r + 1."""

    def __post_init__(self) -> None:
        check_types(self)
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank must be in [0, {self.data_parallel_size}), got "
                f"{self.data_parallel_rank}"
            )
        local, start = self.data_parallel_size_local, self.data_parallel_start_rank
        if local is not None and not 1 <= local <= self.data_parallel_size:
            raise ValueError(f"data_parallel_size_local must be in [1, {self.data_parallel_size}], got {local}")  # fmt: skip
        if not 0 <= start < self.data_parallel_size or start + (local or 0) > self.data_parallel_size:  # fmt: skip
            raise ValueError(
                f"data_parallel_start_rank {start} with data_parallel_size_local {local} does "
                f"not fit data_parallel_size {self.data_parallel_size}"
            )
        if not 0 < self.data_parallel_rpc_port < 65536 - 2 * self.data_parallel_size:
            raise ValueError(f"data_parallel_rpc_port must leave room for {2 * self.data_parallel_size} ports, got {self.data_parallel_rpc_port}")  # fmt: skip
        if self.data_parallel_size > 1 and self.multihost:
            raise ValueError(
                "data_parallel_size > 1 runs whole engines per rank: not with a multi-host "
                "engine (distributed); spread ranks over hosts with --data-parallel-size-local "
                "and --headless"
            )
        if self.tensor_parallel_size is not None and self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and self.process_id < 0:
            raise ValueError(f"process_id must be >= 0, got {self.process_id}")

    @property
    def multihost(self) -> bool:
        """Whether this process is asked to join a multi-host run."""
        return self.distributed or any(
            v is not None for v in (self.coordinator_address, self.num_processes, self.process_id)
        )

    @property
    def local_ranks(self) -> range:
        """The data-parallel ranks this host runs."""
        start = self.data_parallel_start_rank
        return range(start, start + (self.data_parallel_size_local or self.data_parallel_size - start))  # fmt: skip

    def rank_ports(self, rank: int) -> tuple[int, int]:
        """The API server's (input, output) ports for another host's rank `rank`."""
        port = self.data_parallel_rpc_port + 2 * rank
        return port, port + 1


@dataclasses.dataclass(frozen=True)
class SpecMethod:
    """A validated speculative decoding setup (`SpeculativeConfig.method`)."""

    method: str  # "ngram", "draft_model", "eagle3" or "mtp"
    num_speculative_tokens: int  # k: the most draft tokens verified per request and step
    prompt_lookup_min: int = 0  # ngram: the shortest and longest suffix n-gram looked up
    prompt_lookup_max: int = 0
    # draft_model: its checkpoint (any `model` this engine loads); eagle3: the head's directory;
    # mtp: the checkpoint holding the layers (None: the target's own, as vLLM defaults)
    model: str | None = None
    # Speculate only where measured to pay (`jaxllm.engine.spec_policy`); and never in a step
    # of this many running requests or more (vLLM's disable_by_batch_size).
    adaptive: bool = True
    disable_by_batch_size: int | None = None

    @property
    def may_pause(self) -> bool:
        """Whether some steps may run without speculating."""
        return self.adaptive or self.disable_by_batch_size is not None


MAX_SPECULATIVE_TOKENS = 16
_SPEC_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "adaptive",
    "disable_by_batch_size",
    "draft_tensor_parallel_size",
}


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding."""

    speculative_config: dict | None = None
    """vLLM's JSON: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
    "prompt_lookup_min": m} proposes the k tokens that followed the latest earlier occurrence
    of the sequence's last n..m tokens; {"model": PATH, "num_speculative_tokens": k} runs a
    draft model with the target's vocabulary; {"method": "eagle3", "model": HEAD,
    "num_speculative_tokens": k} an EAGLE-3 head in the layout vLLM loads; {"method": "mtp",
    "num_speculative_tokens": k} the checkpoint's own multi-token-prediction layer (DeepSeek-V3,
    repeated for k > 1 as vLLM does; k defaults to 1, the layers DeepSeek's checkpoints have;
    "deepseek_mtp" is vLLM's older name). The target verifies
    the drafts in its next step: the output is the one without speculation (a speculating step
    runs synchronously). Any method also takes "disable_by_batch_size": n (vLLM's: no
    speculation in a step of n running requests or more) and "adaptive" (default true: verify
    k drafts, one or none at each batch size, whichever was measured to give the most tokens a
    second, see `jaxllm.engine.spec_policy`; false: k always). vLLM's
    "draft_tensor_parallel_size" is taken: a draft model or head runs split as the target is."""

    def __post_init__(self) -> None:
        parse_json_field(self, "speculative_config")
        check_types(self)
        _ = self.method  # validates the setup now, naming what is wrong

    @functools.cached_property
    def method(self) -> SpecMethod | None:
        """The setup, validated; None when speculative decoding is off."""
        c = self.speculative_config
        if c is None:
            return None
        unknown = sorted(set(c) - _SPEC_KEYS)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)} (known: "
                f"{', '.join(sorted(_SPEC_KEYS))})"
            )

        def integer(key: str, default: int | None, low: int, high: int) -> int:
            value = c.get(key, default)
            if value is None:
                raise ValueError(f"speculative_config: {key} is required")
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(
                    f"speculative_config: {key} must be an integer in [{low}, {high}], got "
                    f"{value!r}"
                )
            return value

        # vLLM's default for an MTP layer: the layers the checkpoint has (DeepSeek's: 1).
        default_k = 1 if c.get("method") in ("mtp", "deepseek_mtp") else None
        k = integer("num_speculative_tokens", default_k, 1, MAX_SPECULATIVE_TOKENS)
        adaptive = c.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(
                f"speculative_config: adaptive must be true or false, got {adaptive!r}"
            )
        limit = c.get("disable_by_batch_size")
        if limit is not None:
            limit = integer("disable_by_batch_size", limit, 1, 1 << 20)
        policy = {"adaptive": adaptive, "disable_by_batch_size": limit}
        # vLLM's docs pass it; a draft model or head here always runs split as the target is
        # (the same output; 1 or the target's size both mean that).
        if c.get("draft_tensor_parallel_size") is not None:
            integer("draft_tensor_parallel_size", None, 1, 1 << 16)
        model = c.get("model")
        method = c.get("method", "draft_model" if model is not None else None)
        if method == "ngram":
            if model is not None:
                raise ValueError("speculative_config: method ngram takes no model")
            # vLLM's defaults: 5 and 5 when neither is given, else the one given for both.
            lo, hi = c.get("prompt_lookup_min"), c.get("prompt_lookup_max")
            lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
            lo = integer("prompt_lookup_min", lo, 1, 1024)
            hi = integer("prompt_lookup_max", hi, 1, 1024)
            if lo > hi:
                raise ValueError(
                    f"speculative_config: prompt_lookup_min ({lo}) must be <= "
                    f"prompt_lookup_max ({hi})"
                )
            return SpecMethod("ngram", k, lo, hi, **policy)
        if method in ("draft_model", "eagle3"):
            what = "a draft model" if method == "draft_model" else "eagle3"
            if not isinstance(model, str) or not model:
                raise ValueError(f"speculative_config: {what} needs model (its path)")
            extra = {"prompt_lookup_min", "prompt_lookup_max"} & set(c)
            if extra:
                raise ValueError(f"speculative_config: {', '.join(sorted(extra))} is for ngram")
            return SpecMethod(method, k, model=model, **policy)
        if method in ("mtp", "deepseek_mtp"):
            if model is not None and (not isinstance(model, str) or not model):
                raise ValueError(
                    "speculative_config: mtp's model must be a path (default: the target's)"
                )
            extra = {"prompt_lookup_min", "prompt_lookup_max"} & set(c)
            if extra:
                raise ValueError(f"speculative_config: {', '.join(sorted(extra))} is for ngram")
            return SpecMethod("mtp", k, model=model, **policy)
        raise ValueError(
            f"speculative_config: method must be ngram, draft_model, eagle3 or mtp (or give a "
            f"model), got {method!r}"
        )


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (vLLM's flags): many PEFT adapters over the one base model, each request
    naming its own (or none), served in the same batch."""

    enable_lora: bool = False
    """Serve LoRA adapters (`LoRARequest` offline; the server's --lora-modules and `model`)."""
    max_loras: int = 1
    """Adapters on the device at once: the most distinct ones in a step (others wait)."""
    max_lora_rank: int = 16
    """The largest rank an adapter may have (every slot is padded to it)."""
    max_cpu_loras: int | None = None
    """Adapters kept read in host memory (least recently used dropped); default max_loras."""

    def __post_init__(self) -> None:
        check_types(self)
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )


@dataclasses.dataclass(frozen=True)
class MultiModalConfig:
    """Image inputs of an image-text model (vLLM's flags)."""

    limit_mm_per_prompt: dict | None = None
    """The most items of each modality one prompt may carry, as vLLM's JSON: {"image": 4};
    default 16 images."""
    allowed_local_media_path: str | None = None
    """A directory whose files (and only those) requests may name as `file://` image URLs;
    default: none may."""
    allowed_media_domains: tuple[str, ...] | None = None
    """Hosts whose http(s) image URLs requests may name (a host, or its subdomains), fetched
    without redirects within 5 s and 20 MB; default: no URL is fetched."""
    max_num_encoder_input_tokens: int | None = None
    """The most image tokens the vision encoder computes in one step; default
    max_num_batched_tokens (at least one image)."""
    encoder_cache_size: int | None = None
    """Image tokens the encoder cache holds on the device (encoded images, kept while their
    requests need them and reused by image content); default max_num_encoder_input_tokens."""
    enable_mm_embeds: bool = False
    """Prompts may carry image embeddings instead of images (offline, vLLM's
    `{"image": {"image_embeds": ...}}`), written to the encoder cache as they are."""
    mm_processor_kwargs: dict | None = None
    """Settings of the model's HF image processor over its preprocessor_config.json, as
    vLLM's JSON: Qwen2.5-VL's {"max_pixels": 1003520} bounds an image's tokens (here 1280),
    and so the encoder's largest program and the encoder cache."""

    def __post_init__(self) -> None:
        parse_json_field(self, "limit_mm_per_prompt")
        parse_json_field(self, "mm_processor_kwargs")
        if isinstance(self.allowed_media_domains, list | str):
            domains = self.allowed_media_domains
            domains = tuple(domains.split(",") if isinstance(domains, str) else domains)
            object.__setattr__(self, "allowed_media_domains", domains)
        check_types(self)
        limits = self.limit_mm_per_prompt or {}
        for modality, n in limits.items():
            if modality != "image":
                raise ValueError(
                    f"limit_mm_per_prompt: modality {modality!r} is not supported (only image)"
                )
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"limit_mm_per_prompt: image must be an integer >= 0, got {n!r}")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @property
    def image_limit(self) -> int:
        return (self.limit_mm_per_prompt or {}).get("image", 16)

    def encoder_plan(
        self, max_item_tokens: int, block_tokens: int, max_num_batched_tokens: int
    ) -> tuple[int, int]:
        """(the encoder cache's blocks of `block_tokens` rows, the image tokens a step
        encodes): each holds at least the largest image, `max_item_tokens`."""
        budget = max(self.max_num_encoder_input_tokens or max_num_batched_tokens, max_item_tokens)
        size = max(self.encoder_cache_size or budget, max_item_tokens)
        return -(-size // block_tokens), budget


@dataclasses.dataclass(frozen=True)
class ObservabilityConfig:
    """What the engine reports of itself beyond /metrics (vLLM's flags)."""

    disable_log_stats: bool = False
    """Do not log the engine's throughput, queue, KV cache use and speculative decoding every
    10 seconds (`jaxllm.engine.stat_logger`, vLLM's lines). `LLM(...)` does not unless given
    False, as vLLM's."""

    def __post_init__(self) -> None:
        check_types(self)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything that decides how an engine is built, one section per concern.

    `EngineConfig.create(model, max_num_seqs=8, ...)` takes the sections' fields flat, by
    name (the `LLM(...)` keyword arguments); `add_cli_args` and `from_cli` do the same for a
    command line."""

    load: LoadConfig
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    compilation: CompilationConfig = dataclasses.field(default_factory=CompilationConfig)
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    multimodal: MultiModalConfig = dataclasses.field(default_factory=MultiModalConfig)
    observability: ObservabilityConfig = dataclasses.field(default_factory=ObservabilityConfig)

    @staticmethod
    def fields() -> dict[str, tuple[str, dataclasses.Field]]:
        """Every flat field name -> (its section, its field)."""
        return _flat_fields()

    @classmethod
    def create(cls, model: Any, **kwargs: Any) -> EngineConfig:
        """Builds the sections from flat keyword arguments; a name that is no field raises."""
        fields = _flat_fields()
        for alias, name in _vllm_names().items():  # vLLM's keyword arguments, ours renamed
            if alias in kwargs:
                if name in kwargs:
                    raise TypeError(f"engine arguments {name} and {alias} (vLLM's name) both given")
                kwargs[name] = kwargs.pop(alias)
        unknown = sorted(set(kwargs) - set(fields))
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        sections: dict[str, dict[str, Any]] = {s.name: {} for s in dataclasses.fields(cls)}
        kwargs["model"] = model
        for name, value in kwargs.items():
            sections[fields[name][0]][name] = value
        return cls(**{s: type_hints(cls)[s](**values) for s, values in sections.items()})

    def flat(self) -> dict[str, Any]:
        """The inverse of `create`: every field by name."""
        return {
            name: getattr(getattr(self, section), name)
            for name, (section, _) in _flat_fields().items()
        }

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineConfig:
        """The config of a command line parsed by a parser `add_cli_args` filled in."""
        values = {name: getattr(args, name) for name in _flat_fields()}
        return cls.create(values.pop("model"), **values)

    def replace(self, **kwargs: Any) -> EngineConfig:
        """A copy with some flat fields changed."""
        return EngineConfig.create(**{**self.flat(), **kwargs})


@functools.cache
def _flat_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    hints = type_hints(EngineConfig)
    out: dict[str, tuple[str, dataclasses.Field]] = {}
    for section in dataclasses.fields(EngineConfig):
        for f in dataclasses.fields(hints[section.name]):
            assert f.name not in out, f"engine field {f.name!r} is declared twice"
            out[f.name] = (section.name, f)
    return out


@functools.cache
def _vllm_names() -> dict[str, str]:
    """{vLLM's keyword name: our field} for the fields whose flags carry vLLM's spelling as
    an alias (`gpu_memory_utilization`, `block_size`, ...)."""
    return {
        alias.removeprefix("--").replace("-", "_"): name
        for name, (_, f) in _flat_fields().items()
        for alias in f.metadata.get("aliases", ())
        if alias.startswith("--")
    }


def add_cli_args(parser: argparse.ArgumentParser, *, model_flag: bool = False) -> None:
    """Adds a flag per engine field (see `add_dataclass_args`) and the model positional (a
    required `--model` with `model_flag`, as `vllm bench` spells it)."""
    for section in dataclasses.fields(EngineConfig):
        cls = type_hints(EngineConfig)[section.name]
        if cls is LoadConfig:
            doc = field_docs(cls)["model"]
            if model_flag:
                parser.add_argument("--model", required=True, help=doc)
            else:
                parser.add_argument("model", help=doc)
        add_dataclass_args(parser, cls, skip=("model",))

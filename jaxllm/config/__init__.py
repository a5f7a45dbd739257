"""Configuration: one small frozen dataclass per concern, validated on construction.

- `model.py`: `ModelConfig`, the network (from a Hugging Face `config.json` through
  `jaxllm.families.hf_config`, or from GGUF metadata in the same keys).
- `engine.py`: `EngineConfig`, how it is served, one section per concern: `LoadConfig`,
  `CacheConfig`, `SchedulerConfig`, `ParallelConfig`, `CompilationConfig`,
  `SpeculativeConfig`, `LoRAConfig`, `MultiModalConfig` and `ObservabilityConfig`. Each of
  their fields is declared once, with its default and a docstring; the `LLM(...)` keyword
  arguments, the command line's flags (`add_cli_args`, vLLM's names as aliases where vLLM
  has the concept) and their `--help` all come from those declarations.
- `flags.py`: the machinery that reads those declarations (flags, help, type checks).
- `kernels.py`: `CompilationConfig`, and the context that carries its kernel choices into
  the traced step (`using_kernels`, `kernel_choices`).

Every name is imported from here (`from jaxllm.config import EngineConfig`). The package
imports no JAX, so `jaxllm --help` starts fast.
"""

from __future__ import annotations

from jaxllm.config.engine import (
    KV_CACHE_DTYPES,
    MAX_SPECULATIVE_TOKENS,
    QUANTIZATIONS,
    QUANTIZED_KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    LoadConfig,
    LoRAConfig,
    MultiModalConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpecMethod,
    SpeculativeConfig,
    add_cli_args,
    resolve_dtype,
)
from jaxllm.config.flags import add_dataclass_args, field_docs, from_cli_args, option
from jaxllm.config.kernels import (
    ATTENTION_BACKENDS,
    QUANT_MATMUL_BACKENDS,
    REFERENCE_KERNELS,
    CompilationConfig,
    kernel_choices,
    using_kernels,
)
from jaxllm.config.model import LinearAttention, ModelConfig
from jaxllm.families.hf_config import RopeScaling

__all__ = [
    "ATTENTION_BACKENDS",
    "KV_CACHE_DTYPES",
    "MAX_SPECULATIVE_TOKENS",
    "QUANTIZATIONS",
    "QUANTIZED_KV_CACHE_DTYPES",
    "QUANT_MATMUL_BACKENDS",
    "REFERENCE_KERNELS",
    "CacheConfig",
    "CompilationConfig",
    "EngineConfig",
    "LoRAConfig",
    "LoadConfig",
    "LinearAttention",
    "ModelConfig",
    "MultiModalConfig",
    "ObservabilityConfig",
    "ParallelConfig",
    "RopeScaling",
    "SchedulerConfig",
    "SpecMethod",
    "SpeculativeConfig",
    "add_cli_args",
    "add_dataclass_args",
    "field_docs",
    "from_cli_args",
    "kernel_choices",
    "option",
    "resolve_dtype",
    "using_kernels",
]

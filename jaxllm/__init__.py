"""jaxllm: an LLM serving engine on JAX/XLA.

from jaxllm import LLM, SamplingParams

The names below load on first use, so `jaxllm --help` and the server's front end start
without importing JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "LoRARequest",
    "Logprob",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
]

_HOMES = {
    "LLM": "jaxllm.llm",
    "CompletionOutput": "jaxllm.outputs",
    "Logprob": "jaxllm.outputs",
    "LoRARequest": "jaxllm.lora",
    "PoolingParams": "jaxllm.pooling_params",
    "RequestOutput": "jaxllm.outputs",
    "SamplingParams": "jaxllm.sampling_params",
}

if TYPE_CHECKING:
    from jaxllm.llm import LLM
    from jaxllm.lora import LoRARequest
    from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
    from jaxllm.pooling_params import PoolingParams
    from jaxllm.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")

"""The worker: the model runner and what it needs to run steps on the devices (see
`jaxllm.worker.model_runner`), and a pooling model's `EncoderRunner`. It never imports
`jaxllm.engine`; the engine imports the names below only.

The names load on first use, so importing the step data (the front end does, through the
engine's reports) does not import JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_HOMES = {
    "ModelRunner": "jaxllm.worker.model_runner",
    "EncoderRunner": "jaxllm.worker.encoder_runner",
    "InflightStep": "jaxllm.worker.model_runner",
    "CompiledProgram": "jaxllm.worker.compiler",
    "cache_copy_ops": "jaxllm.worker.compiler",
    "make_buckets": "jaxllm.worker.buckets",
    "pick_shape": "jaxllm.worker.buckets",
    "check_draft_config": "jaxllm.worker.spec_decode.draft_model",
    "lora_slot_bytes": "jaxllm.worker.lora_slots",
    "DeviceMemory": "jaxllm.worker.kv_sizing",
    "device_page_bytes": "jaxllm.worker.kv_sizing",
    "engine_bytes": "jaxllm.worker.kv_sizing",
    "gpu_pool_fraction": "jaxllm.worker.kv_sizing",
    "preallocate_gpu_memory": "jaxllm.worker.kv_sizing",
    "resolve_kv_cache_dtype": "jaxllm.worker.kv_sizing",
    "KVCacheGroups": "jaxllm.worker.kv_groups",
    "KVOffloader": "jaxllm.worker.kv_offload",
    "engine_kv_groups": "jaxllm.worker.kv_groups",
    "EnginePlan": "jaxllm.worker.plan",
    "NoRoom": "jaxllm.worker.plan",
    "encoder_plan": "jaxllm.worker.plan",
    "page_layout": "jaxllm.worker.plan",
    "plan_engine": "jaxllm.worker.plan",
    "serving_kind": "jaxllm.worker.plan",
    "encoder_cache_bytes": "jaxllm.worker.mm_encoder",
    "GrammarBitmask": "jaxllm.worker.step_data",
    "FloatArray": "jaxllm.worker.step_data",
    "MultiModalItem": "jaxllm.worker.step_data",
    "EncoderInput": "jaxllm.worker.step_data",
    "NewRequestData": "jaxllm.worker.step_data",
    "PooledChunk": "jaxllm.worker.step_data",
    "PromptTokenLogprobs": "jaxllm.worker.step_data",
    "RunnerOutput": "jaxllm.worker.step_data",
    "ScheduledRequest": "jaxllm.worker.step_data",
    "SchedulerOutput": "jaxllm.worker.step_data",
    "TokenLogprobs": "jaxllm.worker.step_data",
}
__all__ = [
    "CompiledProgram",
    "DeviceMemory",
    "EnginePlan",
    "EncoderInput",
    "EncoderRunner",
    "KVCacheGroups",
    "KVOffloader",
    "GrammarBitmask",
    "InflightStep",
    "ModelRunner",
    "MultiModalItem",
    "NewRequestData",
    "NoRoom",
    "FloatArray",
    "PooledChunk",
    "PromptTokenLogprobs",
    "RunnerOutput",
    "ScheduledRequest",
    "SchedulerOutput",
    "TokenLogprobs",
    "cache_copy_ops",
    "device_page_bytes",
    "engine_bytes",
    "engine_kv_groups",
    "gpu_pool_fraction",
    "preallocate_gpu_memory",
    "resolve_kv_cache_dtype",
    "encoder_cache_bytes",
    "check_draft_config",
    "lora_slot_bytes",
    "encoder_plan",
    "make_buckets",
    "page_layout",
    "pick_shape",
    "plan_engine",
    "serving_kind",
]

if TYPE_CHECKING:
    from jaxllm.worker.buckets import make_buckets, pick_shape
    from jaxllm.worker.compiler import CompiledProgram, cache_copy_ops
    from jaxllm.worker.encoder_runner import EncoderRunner
    from jaxllm.worker.kv_groups import KVCacheGroups, engine_kv_groups
    from jaxllm.worker.kv_offload import KVOffloader
    from jaxllm.worker.kv_sizing import (
        DeviceMemory,
        device_page_bytes,
        engine_bytes,
        gpu_pool_fraction,
        preallocate_gpu_memory,
        resolve_kv_cache_dtype,
    )
    from jaxllm.worker.lora_slots import lora_slot_bytes
    from jaxllm.worker.mm_encoder import encoder_cache_bytes
    from jaxllm.worker.model_runner import InflightStep, ModelRunner
    from jaxllm.worker.plan import (
        EnginePlan,
        NoRoom,
        encoder_plan,
        page_layout,
        plan_engine,
        serving_kind,
    )
    from jaxllm.worker.spec_decode.draft_model import check_draft_config
    from jaxllm.worker.step_data import (
        EncoderInput,
        FloatArray,
        GrammarBitmask,
        MultiModalItem,
        NewRequestData,
        PooledChunk,
        PromptTokenLogprobs,
        RunnerOutput,
        ScheduledRequest,
        SchedulerOutput,
        TokenLogprobs,
    )


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxllm.worker' has no attribute {name!r}")

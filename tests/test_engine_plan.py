"""The engine plan (`jaxllm.worker.plan`): what `serve` and `jaxllm compile` both size the
device's memory and decide the serving kind from, and the model cache and step extras the
step programs carry (`jaxllm.models.state`)."""

from __future__ import annotations

import dataclasses
import inspect
import json

import jax
import jax.numpy as jnp
import pytest

from jaxllm.config import EngineConfig
from jaxllm.loaders import load_config
from jaxllm.models import ModelCache, StepExtras
from jaxllm.worker import DeviceMemory, ModelRunner, NoRoom, plan_engine, serving_kind
from jaxllm.worker.programs import forward


def _plan(path, memory: DeviceMemory | None = None, **flags):
    """The plan on the CPU (no memory limit: `cpu_kv_cache_gib`), or with `memory`."""
    config = EngineConfig.create(str(path), max_num_seqs=4, max_num_batched_tokens=64, **flags)
    memory = memory or DeviceMemory(None)
    return plan_engine(config, load_config(path), memory, dtype=jnp.float32)


def test_the_pool_gets_what_the_other_consumers_leave(tiny_model_dir):
    """Every consumer of device memory is an entry of the plan, and the KV pool is sized
    after all of them: serving LoRA adapters takes their slots' bytes out of the pool."""
    gib = 2**-6  # 16 MiB on the CPU
    plain = _plan(tiny_model_dir, cpu_kv_cache_gib=gib, max_model_len=256)
    lora = _plan(
        tiny_model_dir, cpu_kv_cache_gib=gib, max_model_len=256, enable_lora=True, max_lora_rank=8
    )
    assert set(plain.memory) == {
        "weights",
        "lora slots",
        "encoder cache",
        "recurrent state",
        "kv cache",
    }
    assert plain.memory["recurrent state"] == 0  # no linear-attention layers
    assert plain.memory["lora slots"] == 0 and lora.memory["lora slots"] > 0
    budget = int(gib * 2**30)
    assert plain.num_pages == budget // plain.page_bytes
    assert lora.num_pages == (budget - lora.memory["lora slots"]) // lora.page_bytes
    assert lora.memory["kv cache"] == lora.num_pages * lora.page_bytes
    # The resolved config carries what the plan decided.
    assert lora.config.cache.num_pages == lora.num_pages
    assert lora.config.scheduler.max_model_len == 256


def test_an_accelerator_pool_is_what_the_weights_leave(tiny_model_dir):
    """With a device's usable bytes, the weights come out of them first; too little for two
    pages is refused naming the setting."""
    plain = _plan(tiny_model_dir, max_model_len=256)
    usable = 64 * plain.page_bytes
    plan = _plan(tiny_model_dir, DeviceMemory(usable, 16 * plain.page_bytes), max_model_len=256)
    assert plan.num_pages == 48 and plan.budget_bytes == 48 * plain.page_bytes
    with pytest.raises(NoRoom, match="memory_utilization=0.9: weights"):
        _plan(tiny_model_dir, DeviceMemory(usable, usable - plain.page_bytes))
    given = _plan(tiny_model_dir, DeviceMemory(usable, usable), num_pages=32)
    # num_pages given: taken as it is, what the memory would have held still reported.
    assert given.num_pages == 32 and given.budget_bytes == 0


def test_the_serving_kind_is_decided_once(tiny_model_dir, tmp_path):
    config = EngineConfig.create(str(tiny_model_dir))
    assert serving_kind(config) == "generate"
    pooling = EngineConfig.create(str(tiny_model_dir), runner="pooling")
    assert serving_kind(pooling) == "pooling"
    assert _plan(tiny_model_dir, runner="pooling", max_model_len=64).pooling
    assert not _plan(tiny_model_dir, max_model_len=64).pooling
    with pytest.raises(ValueError, match="pooler_config"):
        serving_kind(
            EngineConfig.create(str(tiny_model_dir), pooler_config={"pooling_type": "MEAN"})
        )
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(
        json.dumps({"architectures": ["BertModel"], "model_type": "bert"})
    )
    assert serving_kind(EngineConfig.create(str(bert))) == "encoder"


def test_the_runner_takes_the_plan_and_few_parameters():
    params = inspect.signature(ModelRunner.__init__).parameters
    assert len(params) <= 8, list(params)
    assert list(params)[:4] == ["self", "model", "config", "plan"]


def test_cache_and_extras_are_pytrees_the_forward_pass_takes_whole():
    """The forward program takes the model cache and the step's extras as one value each:
    their fields (a new kind of cache state, a new step input) are not parameters of it."""
    names = list(inspect.signature(forward).parameters)
    assert names[4:8] == ["cache", "last_tokens", "batch", "resident"]
    kv = jnp.zeros((1, 2, 1, 4, 8))
    cache = ModelCache(kv=kv)
    leaves, tree = jax.tree.flatten(cache)
    assert len(leaves) == 1 and jax.tree.unflatten(tree, leaves).kv is kv
    assert cache.nbytes == kv.nbytes
    step = StepExtras(lora_slots=jnp.zeros(3, jnp.int32))
    resident = StepExtras(mm_pool=jnp.ones((2, 4)))
    merged = step.merged(resident)
    assert merged.lora_slots is step.lora_slots and merged.mm_pool is resident.mm_pool
    assert merged.image_embeds() == (resident.mm_pool, None) and merged.layer_loras() is None
    assert [f.name for f in dataclasses.fields(StepExtras)] == [
        "lora",
        "lora_slots",
        "mm_pool",
        "mm_rows",
        "state_slots",
    ]
    assert len(jax.tree.leaves(StepExtras())) == 0
    # A hybrid model's recurrent state is one more field of the same cache value.
    assert [f.name for f in dataclasses.fields(ModelCache)] == ["kv", "linear"]

"""DeepSeek-V2/V3 through the engine, beyond the family checks of test_model_families.py
(logits, greedy tokens chunked and from the prefix cache): a V3 without q's low rank under
preemption and batching, the latent cache's bytes, the checkpoints' multi-token-prediction
layers skipped, and what is refused by name."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxllm import LLM, SamplingParams
from jaxllm.config import ModelConfig
from jaxllm.loaders import load_model
from jaxllm.worker.kv_sizing import bytes_per_page
from pallas_kernels import get_kv_cache_shape, mla_attention
from pallas_kernels.kv_cache import abstract_kv_cache

from helpers import VOCAB, greedy_reference, prefill_logits, write_family_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V3_CONFIG = "benchmarks/configs/deepseek-v3/config.json"


def test_greedy_tokens_under_preemption_without_q_low_rank(tmp_path):
    """V3 with a plain q projection (q_lora_rank None): four growing requests on too few
    pages, chunked and batched; the newest are preempted and recomputed, and every request
    gets transformers' greedy tokens."""
    hf_model = write_family_checkpoint("deepseek-v3", tmp_path, q_lora_rank=None)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (30, 25, 33, 20)]
    expected = greedy_reference(hf_model, prompts, 24)
    llm = LLM(
        tmp_path,
        dtype="float32",
        page_size=8,
        num_pages=16,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=128,
        skip_warmup=True,
    )
    assert llm.model_config.latent_attention.q_lora_rank is None
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in out] == expected


def test_greedy_tokens_through_the_tpu_kernel(tmp_path, monkeypatch):
    """The engine with attention_backend "pallas" runs latent attention through the TPU
    kernel (interpreted on the CPU) inside its jitted step: three requests chunked and
    batched, transformers' greedy tokens."""
    hf_model = write_family_checkpoint("deepseek-v3", tmp_path)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (21, 9, 14)]
    expected = greedy_reference(hf_model, prompts, 8)
    traced, kernel = [], mla_attention.mla_paged_attention_tpu
    monkeypatch.setattr(
        mla_attention,
        "mla_paged_attention_tpu",
        lambda *a, **k: traced.append(1) or kernel(*a, **k),
    )
    llm = LLM(tmp_path, dtype="float32", page_size=8, num_pages=32, max_model_len=64,
              max_num_seqs=4, max_num_batched_tokens=16, attention_backend="pallas",
              skip_warmup=True)  # fmt: skip
    assert llm.attention_backend == "pallas_tpu"  # "pallas" on the CPU
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert traced and [o.outputs[0].token_ids for o in out] == expected


def test_an_odd_row_width(tmp_path):
    """A latent and RoPE key of odd total width (41 + 8): a pair row of 98 lanes in a cache
    of 100 (the config's half-row width rounds up); logits and greedy tokens are
    transformers'."""
    hf_model = write_family_checkpoint("deepseek-v3", tmp_path, kv_lora_rank=41)
    ids = np.random.default_rng(5).integers(3, VOCAB, size=30).tolist()
    loaded = load_model(tmp_path, dtype=jnp.float32, load_tokenizer=False)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(prefill_logits(loaded.model, loaded.config, ids) - ref).max() < 1e-4
    llm = LLM(tmp_path, dtype="float32", page_size=8, num_pages=32, max_model_len=128,
              max_num_seqs=2, max_num_batched_tokens=16, skip_warmup=True)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    assert [out[0].outputs[0].token_ids] == greedy_reference(hf_model, [ids], 12)


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"], ids=["cpu", "gpu", "tpu"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_latent_cache_bytes_per_token(platform, dtype):
    """DeepSeek-V3's cache holds one row of 576 values per token and layer (its latent and
    its RoPE key), whatever its 128 heads: 61 x 576 x 2 bytes in bfloat16 on every platform,
    a TPU's too (two rows to a pair row of 9 whole tiles, where tpu-inference pads each row to
    640). An 8-bit cache adds a float32 scale per row. The shape the engine allocates holds
    exactly that."""
    config = ModelConfig.from_hf_config(json.loads(open(V3_CONFIG).read()))
    per_token = bytes_per_page(config, 16, dtype, platform) / 16
    itemsize = jnp.dtype(dtype).itemsize
    scales = 0 if dtype == jnp.bfloat16 else 4
    assert per_token == config.num_layers * (576 * itemsize + scales)
    if dtype == jnp.bfloat16:
        assert per_token == 61 * 576 * 2  # 70,272 bytes
    shape = get_kv_cache_shape(61, 10, 16, 1, config.cache_head_dim, platform, latent=True)
    data = abstract_kv_cache(shape, dtype).data
    assert data.size * data.dtype.itemsize == 61 * 10 * 16 * 576 * itemsize


def test_the_engine_cache_holds_one_row_per_token(tmp_path):
    """The live cache of a tiny V3: one kv head whose pair rows hold two tokens' rows
    [latent (40) | RoPE key (8)], nothing per head."""
    write_family_checkpoint("deepseek-v3", tmp_path)
    llm = LLM(tmp_path, dtype="float32", page_size=8, num_pages=16, skip_warmup=True)
    shape = llm.runner.device.kv_cache.shape
    assert shape == (4, 16, 1, 8 // 2, 2 * (40 + 8))


def test_multi_token_prediction_layers_are_skipped(tmp_path):
    """A checkpoint with V3's MTP module as layer `num_hidden_layers` (as the Hub's has it:
    a decoder layer plus its projections) loads, the extra layer ignored."""
    hf_model = write_family_checkpoint("deepseek-v3", tmp_path, tokenizer=False)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    n = hf_model.config.num_hidden_layers
    for name, value in list(tensors.items()):
        if name.startswith("model.layers.1."):
            tensors[name.replace("model.layers.1.", f"model.layers.{n}.")] = value
    d = hf_model.config.hidden_size
    tensors[f"model.layers.{n}.eh_proj.weight"] = np.zeros((d, 2 * d), np.float32)
    tensors[f"model.layers.{n}.enorm.weight"] = np.ones(d, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = load_model(tmp_path, dtype=jnp.float32, load_tokenizer=False)
    ids = np.random.default_rng(0).integers(3, VOCAB, size=20).tolist()
    ours = prefill_logits(loaded.model, loaded.config, ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - ref).max() < 1e-4


def test_the_router_stays_float32_in_a_bfloat16_model(tmp_path):
    """The router and its correction bias are float32 in a bfloat16 model, as transformers keeps
    them (the bias is added to sigmoid scores closer together than bfloat16 resolves), loaded
    from the checkpoint, from its orbax conversion, or made at random."""
    from jaxllm.loaders.convert import convert

    write_family_checkpoint("deepseek-v3", tmp_path / "hf", tokenizer=False)
    convert(tmp_path / "hf", tmp_path / "orbax", dtype=jnp.bfloat16)
    for path, fmt in ((tmp_path / "hf", "auto"), (tmp_path / "orbax", "auto"),
                      (tmp_path / "hf", "dummy")):  # fmt: skip
        loaded = load_model(path, dtype=jnp.bfloat16, load_tokenizer=False, load_format=fmt)
        moe = loaded.model.layers[1].mlp
        assert moe.router.get_value().dtype == jnp.float32, (path, fmt)
        assert moe.score_bias.get_value().dtype == jnp.float32, (path, fmt)
        assert moe.gate_proj.get_value().dtype == jnp.bfloat16, (path, fmt)


def test_refusals_name_what_is_not_served(tmp_path):
    """LoRA adapters (latent attention has no q/k/v projections of the usual shapes) and
    biased attention projections are refused, each naming the parameter."""
    write_family_checkpoint("deepseek-v3", tmp_path)
    with pytest.raises(ValueError, match="enable_lora.*latent attention"):
        LLM(tmp_path, dtype="float32", enable_lora=True, skip_warmup=True)
    config = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ValueError, match="attention_bias"):
        ModelConfig.from_hf_config(config | {"attention_bias": True})
    with pytest.raises(ValueError, match="topk_method"):
        ModelConfig.from_hf_config(config | {"topk_method": "greedy"})

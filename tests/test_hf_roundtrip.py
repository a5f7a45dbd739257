"""Hugging Face round trip without network: tiny random models written by transformers
itself, loaded by our loader, logits compared with transformers (torch, float32)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.loaders import load_model

from helpers import prefill_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

CASES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=10000.0)),
    "llama3-rope-tied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # attention_bias: biases on q, k, v and o.
    "llama-attention-bias": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(attention_bias=True),
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(rope_theta=1000000.0)),
    "qwen2-tied-mha": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=True, num_key_value_heads=8),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    hf_config = config_cls(**{**COMMON, **extra})
    hf_model = model_cls(hf_config).eval()
    with torch.no_grad():  # biases are zero at init; make them count
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    # A small shard size forces a sharded checkpoint with an index file.
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()

    loaded = load_model(tmp_path, dtype=jnp.float32, load_tokenizer=False)
    assert loaded.config.architecture == model_cls.__name__
    ids = np.random.default_rng(0).integers(0, COMMON["vocab_size"], size=100).tolist()
    ours = prefill_logits(loaded.model, loaded.config, ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    diff = np.abs(ours - ref).max()
    print(f"{case}: max abs logit diff {diff:.2e} (logit scale {np.abs(ref).max():.2f})")
    assert diff < 1e-4, diff
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_bfloat16_weights_load(tmp_path):
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval()
    hf_model.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(tmp_path, dtype=jnp.bfloat16, load_tokenizer=False)
    assert loaded.model.embed_tokens[...].dtype == jnp.bfloat16
    ids = list(range(1, 40))
    ours = prefill_logits(loaded.model, loaded.config, ids)
    with torch.no_grad():
        ref = hf_model.float()(torch.tensor([ids])).logits[0].numpy()
    # bf16 activations: agreement to bf16 precision, not bit for bit.
    assert np.abs(ours - ref).max() < 0.1 * max(1.0, np.abs(ref).max())

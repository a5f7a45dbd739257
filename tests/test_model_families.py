"""Every model family against Hugging Face transformers (torch, float32): tiny random
checkpoints written by transformers itself, loaded by our loader.

Per family: the logits of a prompt longer than the sliding window within 1e-4, and 32 greedy
tokens through the engine identical to transformers' `generate`, with chunked prefill crossing
the window boundary and a second run served from the prefix cache.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.loaders import load_model
from jaxllm.testing import write_tiny_tokenizer

from helpers import prefill_logits, tensor_parallel_report

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 400
WINDOW = 24
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,  # not hidden / heads
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SLIDING, FULL = "sliding_attention", "full_attention"
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=40)

CASES = {
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            sliding_window=WINDOW,
            layer_types=[SLIDING, SLIDING, FULL, SLIDING],
            query_pre_attn_scalar=32,
            rope_parameters={
                FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),
    "gemma2-softcap": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            sliding_window=WINDOW,
            query_pre_attn_scalar=32,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    "llama3.1-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=6, norm_topk_prob=True, mlp_only_layers=[1], **MOE),
    ),
    "qwen3-moe-sparse-step": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, norm_topk_prob=False, decoder_sparse_step=2, **MOE),
    ),
}


def write_checkpoint(case: str, path, **overrides) -> object:
    """Writes a tiny random checkpoint of `case` (and a tokenizer) to `path`; returns the
    transformers model."""
    config_name, model_name, extra = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**COMMON, **extra, **overrides})
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # norms start at 0 or 1 and biases at 0: make every weight count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.02))
    model.save_pretrained(path, safe_serialization=True)
    write_tiny_tokenizer(path, vocab_size=VOCAB)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, write_checkpoint(request.param, path)


def test_logits_match_transformers(family):
    case, path, hf_model = family
    loaded = load_model(path, dtype=jnp.float32, load_tokenizer=False)
    assert loaded.config.architecture == CASES[case][1]
    ids = np.random.default_rng(0).integers(3, VOCAB, size=3 * WINDOW + 5).tolist()
    ours = prefill_logits(loaded.model, loaded.config, ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    diff = np.abs(ours - ref).max()
    print(f"{case}: max abs logit diff {diff:.2e} (logit scale {np.abs(ref).max():.2f})")
    assert diff < 1e-4, diff


def test_greedy_tokens_match_transformers(family):
    """32 greedy tokens each for prompts shorter and longer than the window, computed in
    chunks of 16 tokens (so prefills cross the window boundary mid-chunk), then again with
    their prefixes served from the cache."""
    case, path, hf_model = family
    rng = np.random.default_rng(1)
    shared = rng.integers(3, VOCAB, size=2 * WINDOW + 8).tolist()
    prompts = [
        rng.integers(3, VOCAB, size=WINDOW // 2).tolist(),
        shared + rng.integers(3, VOCAB, size=5).tolist(),
        shared + rng.integers(3, VOCAB, size=11).tolist(),
    ]
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32
            )
        expected.append(out[0, len(ids) :].tolist())

    llm = LLM(
        path,
        dtype="float32",
        page_size=8,
        num_pages=64,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=256,
        skip_warmup=True,
    )
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    first = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    hits = llm.kv_cache_manager.prefix_cache_hits
    again = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    assert llm.kv_cache_manager.prefix_cache_hits - hits >= 2 * len(shared) // 8 * 8
    assert first == expected, case
    assert again == expected, case


@pytest.mark.parametrize(
    "case,extra,expert_parallel",
    [
        # 8 experts: split over the expert axis at every size (each device holds 8 / tp).
        ("qwen3-moe", dict(num_experts=8), True),
        # 6 experts do not split 4 ways: at 4 each expert's MLP width is split instead.
        ("mixtral", dict(num_local_experts=6), False),
    ],
)
def test_moe_under_tensor_and_expert_parallelism(case, extra, expert_parallel, tmp_path):
    """1, 2 and 4 fake CPU devices: the same greedy tokens, no compilation after warmup, and
    each device holding 1/tp of the expert weights."""
    write_checkpoint(case, tmp_path / "ckpt", **extra)
    rows = tensor_parallel_report(tmp_path / "ckpt", "1,2,4", tmp_path)
    for r in rows:
        print(f"tp {r['tp']}: expert bytes per device {r['expert_bytes_per_device']:,} of "
              f"{r['expert_bytes']:,}")  # fmt: skip
    assert [r["same_tokens_as_first"] for r in rows] == [True] * 3
    assert [r["compiled_after_warmup"] for r in rows] == [0] * 3
    whole = rows[0]["expert_bytes"]
    assert whole > 0
    assert [r["expert_bytes_per_device"] for r in rows] == [whole, whole // 2, whole // 4]

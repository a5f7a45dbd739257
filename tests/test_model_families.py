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

from helpers import (
    FAMILIES,
    FAMILY_COMMON,
    VOCAB,
    WINDOW,
    bfloat16_errors,
    prefill_logits,
    tensor_parallel_report,
    write_family_checkpoint,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, write_family_checkpoint(request.param, path)


def test_logits_match_transformers(family):
    case, path, hf_model = family
    loaded = load_model(path, dtype=jnp.float32, load_tokenizer=False)
    assert loaded.config.architecture == FAMILIES[case][1]
    ids = np.random.default_rng(0).integers(3, VOCAB, size=3 * WINDOW + 5).tolist()
    ours = prefill_logits(loaded.model, loaded.config, ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    diff = np.abs(ours - ref).max()
    print(f"{case}: max abs logit diff {diff:.2e} (logit scale {np.abs(ref).max():.2f})")
    assert diff < 1e-4, diff


def test_bfloat16_error_is_no_worse_than_transformers(family):
    """In bfloat16 our logits stray from the float32 truth no more than transformers' own
    bfloat16 run does (twice its error, plus slack for a different summation order)."""
    case, path, hf_model = family
    ids = np.random.default_rng(2).integers(3, VOCAB, size=2 * WINDOW + 5).tolist()
    ours_err, theirs_err = bfloat16_errors(path, hf_model, ids)
    print(f"{case} bfloat16: max abs error ours {ours_err:.3g}, transformers {theirs_err:.3g}")
    assert ours_err <= 2 * theirs_err + 1e-2, (ours_err, theirs_err)


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
        # gemma4-moe's full layers fill two cache slots each: 256 tokens would need 72 pages
        max_model_len=128,
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
        pytest.param("qwen3-moe", dict(num_experts=8), True, marks=pytest.mark.slow),
        # 6 experts do not split 4 ways: at 4 each expert's MLP width is split instead.
        pytest.param("mixtral", dict(num_local_experts=6), False, marks=pytest.mark.slow),
        # gpt-oss, 6 experts: split on the expert axis at 2, on each expert's width at 4 (its
        # expert biases split with them, its sinks with the heads).
        pytest.param("gpt-oss", dict(num_local_experts=6), False, marks=pytest.mark.slow),
        # Llama 4: its MoE layers (input-weighted experts, an ungated shared expert) between
        # dense ones, 8 experts split on the expert axis.
        pytest.param("llama4", dict(num_local_experts=8), True, marks=pytest.mark.slow),
        # DeepSeek-V3: latent attention's heads split, its one latent per token kept whole on
        # every device; 8 experts split on the expert axis.
        pytest.param("deepseek-v3", {}, True, marks=pytest.mark.slow),
    ],
)
def test_moe_under_tensor_and_expert_parallelism(case, extra, expert_parallel, tmp_path):
    """1, 2 and 4 fake CPU devices: the same greedy tokens, no compilation after warmup, and
    each device holding 1/tp of the expert weights."""
    write_family_checkpoint(case, tmp_path / "ckpt", **extra)
    rows = tensor_parallel_report(tmp_path / "ckpt", "1,2,4", tmp_path)
    for r in rows:
        print(f"tp {r['tp']}: expert bytes per device {r['expert_bytes_per_device']:,} of "
              f"{r['expert_bytes']:,}")  # fmt: skip
    assert [r["same_tokens_as_first"] for r in rows] == [True] * 3
    assert [r["compiled_after_warmup"] for r in rows] == [0] * 3
    whole = rows[0]["expert_bytes"]
    assert whole > 0
    assert [r["expert_bytes_per_device"] for r in rows] == [whole, whole // 2, whole // 4]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gemma4", "gemma4-moe"])
def test_gemma4_under_tensor_parallelism(case, tmp_path):
    """2 fake CPU devices: the same greedy tokens as 1. `gemma4`'s cache slot holds one row
    (its sliding layers' 2 kv heads of 24 packed into one 48-wide row, its full layers' 1 of
    48), so its kv heads are repeated twice to split; `gemma4-moe`'s slot holds 2 rows."""
    write_family_checkpoint(case, tmp_path / "ckpt")
    rows = tensor_parallel_report(tmp_path / "ckpt", "1,2", tmp_path)
    assert [r["same_tokens_as_first"] for r in rows] == [True] * 2
    assert [r["compiled_after_warmup"] for r in rows] == [0] * 2


@pytest.mark.parametrize(
    "config_name,extra",
    [
        # Gemma 3 1B's config.json as published: no layer_types, no rope_parameters.
        ("Gemma3TextConfig", dict(sliding_window=512, sliding_window_pattern=6)),
        ("Gemma3TextConfig", dict(sliding_window=512, sliding_window_pattern=3)),
        ("Qwen2Config", dict(sliding_window=64, use_sliding_window=True, max_window_layers=5)),
        ("Qwen3Config", dict(sliding_window=64, use_sliding_window=False)),
        ("MistralConfig", dict(sliding_window=64)),
    ],
)
def test_configs_without_layer_types_derive_them_as_transformers_does(config_name, extra):
    """Older config.json files name no layer types (and Gemma 3's omit its RoPE bases): the
    windows and RoPE of every layer come out as transformers derives them."""
    from jaxllm.config import ModelConfig

    arch = config_name.replace("TextConfig", "ForCausalLM").replace("Config", "ForCausalLM")
    raw = {**COMMON_LEGACY, **extra, "architectures": [arch]}
    ours = ModelConfig.from_hf_config(raw)
    hf = getattr(transformers, config_name)(**raw)
    # Mistral's config has no layer types: its window applies to every layer.
    types = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
    windows = [
        hf.sliding_window if t == "sliding_attention" and hf.sliding_window else None for t in types
    ]
    assert [ours.layer_window(i) for i in range(ours.num_layers)] == windows
    if config_name == "Gemma3TextConfig":
        assert ours.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"] == 1e6
        local = hf.rope_parameters["sliding_attention"]["rope_theta"]
        assert ours.rope_local_theta == local == 1e4


COMMON_LEGACY = dict(
    vocab_size=400,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=12,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
)


def test_gemma3_image_text_checkpoint_serves_its_text_decoder(tmp_path):
    """Gemma 3 4B and up ship as `Gemma3ForConditionalGeneration`: the text decoder loads from
    `text_config` and the `language_model.*` tensors, the vision tower is skipped, and text-only
    logits equal transformers'."""
    text = {**FAMILY_COMMON, **FAMILIES["gemma3"][2]}
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    torch.manual_seed(0)
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4
    )
    hf_model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.02))
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(tmp_path, dtype=jnp.float32, load_tokenizer=False)
    assert loaded.config.layer_window(2) is None and loaded.config.layer_window(0) == WINDOW
    ids = np.random.default_rng(0).integers(3, VOCAB, size=2 * WINDOW + 5).tolist()
    ours = prefill_logits(loaded.model, loaded.config, ids)
    with torch.no_grad():
        ref = hf_model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
    assert np.abs(ours - ref).max() < 1e-4


def test_llama4_image_text_checkpoint_serves_its_text_decoder(tmp_path):
    """Llama 4 ships as `Llama4ForConditionalGeneration`: its text decoder loads from
    `text_config` and the `language_model.*` tensors (q and k reordered for the decoder's
    RoPE), the vision model and projector are skipped, and text-only logits equal
    transformers'."""
    text = {**FAMILY_COMMON, **FAMILIES["llama4"][2]}
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
        projector_output_dim=64, pixel_shuffle_ratio=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    config = transformers.Llama4Config(
        text_config=text, vision_config=vision, image_token_index=VOCAB - 1
    )
    hf_model = transformers.Llama4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.02))
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(tmp_path, dtype=jnp.float32, load_tokenizer=False)
    assert loaded.config.architecture == "Llama4ForCausalLM"
    assert loaded.config.layer_chunk(0) == WINDOW and loaded.config.nope_layers == (1, 3)
    ids = np.random.default_rng(0).integers(3, VOCAB - 1, size=2 * WINDOW + 5).tolist()
    ours = prefill_logits(loaded.model, loaded.config, ids)
    with torch.no_grad():  # (its text-only forward fails in transformers 5.24: the decoder's)
        ref = hf_model.language_model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
    assert np.abs(ours - ref).max() < 1e-4

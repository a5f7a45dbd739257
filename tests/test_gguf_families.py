"""GGUF files of today's families, written as llama.cpp's converters write them
(`gguf_writer`): the mixtures of experts Mixtral (architecture "llama" with experts),
Qwen3-MoE, gpt-oss (float experts, and MXFP4 ones repacked into ggml's MXFP4 type) and
Llama 4, and Gemma 4 (per-layer kinds, head widths, kv heads and MLP widths; per-layer inputs,
shared-KV layers, values equal to keys; its MoE block). Each tiny random checkpoint comes back
as the same tensors, the same config as llama.cpp reads it, and transformers' logits and
greedy tokens on the original."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_mxfp4 import _dequantized, _mxfp4_checkpoint

from jaxllm import LLM, SamplingParams
from jaxllm.config import ModelConfig
from jaxllm.loaders import load_model
from jaxllm.loaders.gguf import gguf_hf_config, iter_gguf
from jaxllm.loaders.gguf_file import GGUFFile
from jaxllm.quantization import MXFP4Experts, QArray, dequantize_np

from gguf_writer import Q, write_gguf
from helpers import VOCAB, prefill_logits, write_family_checkpoint

torch = pytest.importorskip("torch")

# Llama 4 as llama.cpp reads it: it stores none of the attention's settings and fixes chunks of
# 8192, every fourth layer without RoPE, temperature tuning from 8192 (`families/llama4.py`).
# Scout's llama3 RoPE scaling goes as a rope_freqs tensor.
_LLAMA4_AS_LLAMA_CPP = dict(
    num_hidden_layers=4,
    attention_chunk_size=8192,
    no_rope_layer_interval=4,
    floor_scale=8192,
    attn_scale=0.1,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500_000.0,
        "factor": 16.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 1.0,
        "original_max_position_embeddings": 64,
    },
)
CASES = {
    "mixtral": dict(sliding_window=None),  # as Mixtral ships (llama.cpp stores no window)
    "qwen3-moe": dict(mlp_only_layers=[]),  # llama.cpp has no dense Qwen3-MoE layers
    # llama.cpp clamps gpt-oss's SwiGLU at 7 whatever the checkpoint says (as gpt-oss ships).
    "gpt-oss": dict(swiglu_limit=7.0),
    "gpt-oss-mxfp4": dict(swiglu_limit=7.0),
    "llama4": _LLAMA4_AS_LLAMA_CPP,
    # MobileLLM-R1's shape: no chunks, RoPE on every layer (llama.cpp's plain Llama graph).
    "llama4-unchunked": dict(
        num_hidden_layers=4,
        attention_chunk_size=None,
        no_rope_layers=[1, 1, 1, 1],
        attn_temperature_tuning=False,
        floor_scale=8192,  # (moot without temperature tuning; as llama.cpp's defaults)
        attn_scale=0.1,
    ),
    "gemma4": {},
    "gemma4-moe": {},
}
STACKED = {"mixtral", "qwen3-moe", "gpt-oss", "gpt-oss-mxfp4", "llama4", "llama4-unchunked"}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path, object]:
    """(case, HF checkpoint directory, the transformers model of its weights)."""
    case = request.param
    root = tmp_path_factory.mktemp(case)
    if case == "gpt-oss-mxfp4":
        write_family_checkpoint("gpt-oss", root / "float", **CASES[case])
        model = write_family_checkpoint("gpt-oss", root / "float-copy", **CASES[case])
        _mxfp4_checkpoint(root / "float", root / "hf", model)  # `model`: dequantized
        return case, root / "hf", model
    family = case.removesuffix("-unchunked")
    model = write_family_checkpoint(family, root / "hf", **CASES[case])
    return case, root / "hf", model


@pytest.fixture(scope="module")
def gguf_file(checkpoint, tmp_path_factory) -> tuple[Path, dict]:
    case, hf_dir, _ = checkpoint
    path = tmp_path_factory.mktemp(f"{case}-gguf") / "m.gguf"
    return path, write_gguf(hf_dir, path, Q.F32, embed_type=Q.F32)


def test_tensors_round_trip(checkpoint, gguf_file):
    """Every tensor comes back as stored, the stacked experts input-major and MXFP4 ones
    dequantized exactly (by default on the CPU); gpt-oss's MXFP4 file really holds MXFP4."""
    case, _, _ = checkpoint
    path, expected = gguf_file
    got = dict(iter_gguf(path))
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    stacked = [n for n in got if n.endswith("_proj_stacked")]
    assert bool(stacked) == (case in STACKED) and all(got[n].ndim == 3 for n in stacked)
    types = {t.name: t.ggml_type for t in GGUFFile(path).tensors}
    mxfp4 = {n for n, t in types.items() if t == Q.MXFP4}
    if case == "gpt-oss-mxfp4":
        assert mxfp4 == {n for n in types if n.endswith("_exps.weight")}
    else:
        assert not mxfp4


def test_quantized_tensors_round_trip(checkpoint, tmp_path):
    """Q8_0 everywhere (F16 where its blocks do not divide a row, as llama.cpp falls back):
    stacked experts and the permuted q/k rows come back as stored, kept or dequantized."""
    _, hf_dir, _ = checkpoint
    expected = write_gguf(hf_dir, tmp_path / "q8.gguf", Q.Q8_0, embed_type=Q.Q8_0)
    for keep in (False, True):
        got = dict(iter_gguf(tmp_path / "q8.gguf", keep_quantized=keep))
        assert set(got) == set(expected)
        for name, value in expected.items():
            w = got[name]
            if isinstance(w, QArray):
                w = dequantize_np(w).reshape(value.shape)
            np.testing.assert_allclose(w, value, rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("checkpoint", ["gpt-oss-mxfp4"], indirect=True)
def test_mxfp4_experts_are_kept_as_shipped(checkpoint, gguf_file):
    """With `keep_mxfp4` the file's codes and scales become `MXFP4Experts` standing for the
    same input-major weights, bit for bit."""
    path, expected = gguf_file
    kept = dict(iter_gguf(path, keep_mxfp4=True))
    for name, w in kept.items():
        if not name.endswith("_proj_stacked"):
            continue
        assert isinstance(w, MXFP4Experts) and w.shape == expected[name].shape, name
        np.testing.assert_array_equal(_dequantized(w, jnp.float32), expected[name], err_msg=name)


def test_config_is_the_checkpoints(checkpoint, gguf_file):
    """Our ModelConfig from the file's metadata equals the one from config.json, but for what
    GGUF spells differently (no per-layer types where every layer is alike, EOS ids)."""
    import dataclasses

    case, hf_dir, _ = checkpoint
    path, _ = gguf_file
    ours = gguf_hf_config(GGUFFile(path))
    got = ModelConfig.from_hf_config(ours)
    want = ModelConfig.from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    assert got.architecture == want.architecture
    assert got.num_experts == want.num_experts and (got.num_experts > 0) == (case != "gemma4")
    assert got.dense_layers == want.dense_layers
    same = dict(rms_norm_eps=want.rms_norm_eps, eos_token_ids=want.eos_token_ids, bos_token_id=None)
    if set(want.layer_types) <= {"full_attention"}:
        same["layer_types"] = want.layer_types
    if want.rope_scaling is not None and want.rope_scaling.rope_type == "llama3":
        # A rope_freqs tensor instead (the logits below check that it turns the same way).
        assert got.rope_freq_factors and got.rope_scaling is None
        same["rope_freq_factors"] = None
        want = dataclasses.replace(want, rope_scaling=None)
    assert dataclasses.replace(got, **same) == dataclasses.replace(want, bos_token_id=None)
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)


def test_logits_equal_transformers(checkpoint, gguf_file):
    case, _, hf_model = checkpoint
    path, _ = gguf_file
    loaded = load_model(path, dtype=jnp.float32, load_tokenizer=False)
    ids = [1] + np.random.default_rng(5).integers(3, VOCAB, size=47).tolist()  # past the window
    ours = prefill_logits(loaded.model, loaded.config, ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    diff = np.abs(ours - ref).max()
    print(f"{case} GGUF: max abs logit diff vs transformers {diff:.2e}")
    assert diff < 1e-3 * max(1.0, np.abs(ref).max())


def test_greedy_tokens_chunked_and_batched(checkpoint, gguf_file):
    """Greedy tokens equal transformers' for prompts past the sliding window, prefilled in
    chunks beside another request; gpt-oss's MXFP4 experts kept 4-bit (`quantization="mxfp4"`,
    dequantized inside the step) give the same tokens."""
    case, _, hf_model = checkpoint
    path, _ = gguf_file
    rng = np.random.default_rng(7)
    prompts = [[1] + rng.integers(3, VOCAB, size=n).tolist() for n in (37, 21)]
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12
            )
        expected.append(out[0, len(ids) :].tolist())
    quantizations = [None] + (["mxfp4"] if case == "gpt-oss-mxfp4" else [])
    for quantization in quantizations:
        llm = LLM(
            path, dtype="float32", quantization=quantization, page_size=8, num_pages=80,
            max_num_seqs=2, max_num_batched_tokens=16, max_model_len=128, skip_warmup=True,
        )  # fmt: skip
        if quantization == "mxfp4":  # really kept: codes and scales on the device
            experts = [
                v.get_value() for k, v in nnx.to_flat_state(llm.runner.state) if k[-1] == "up_proj"
            ]
            assert experts and all(isinstance(w, MXFP4Experts) for w in experts)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected, quantization


def test_mxfp4_asked_of_a_file_without_it_is_refused(tmp_path):
    hf_dir = tmp_path / "hf"
    write_family_checkpoint("qwen3-moe", hf_dir, tokenizer=False, **CASES["qwen3-moe"])
    write_gguf(hf_dir, tmp_path / "m.gguf", Q.F32)
    with pytest.raises(ValueError, match="quantization mxfp4: .* has no MXFP4 tensors"):
        load_model(tmp_path / "m.gguf", quantization="mxfp4", load_tokenizer=False)


def test_experts_without_a_used_count_are_refused(tmp_path):
    """llama.cpp asserts a used count where there are experts; so do we, naming the key."""
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_expert_count(4)
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="lacks qwen3moe.expert_used_count"):
        gguf_hf_config(GGUFFile(path))

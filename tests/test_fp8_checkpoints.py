"""Fine-grained FP8 checkpoints (`quant_method: fp8`, as DeepSeek-V3 and the "-FP8" releases of
Qwen3 and others ship): float8 e4m3 weights with a float32 factor per block of
`weight_block_size`. Tiny random checkpoints quantized here are loaded by transformers (which
dequantizes them on the CPU) and by us, kept fp8: the same weights exactly, the same logits,
and the same greedy tokens, chunked and batched."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.loaders import load_model
from jaxllm.loaders.quantized_hf import fp8_blocks
from jaxllm.quantization import FP8Experts, QArray, dequantize_experts, dequantize_np
from jaxllm.testing import write_fp8_checkpoint

from helpers import VOCAB, prefill_logits, write_family_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Blocks dividing every tiny weight (several per weight): transformers' CPU dequantizer
# derives the block from the scale grid (rows // grid rows), which equals the format's ceil
# grid only where blocks divide; partial last blocks (DeepSeek-V3's 576-row kv_a_proj) are
# checked against the format's rule in test_blocks_become_exact_groups.
BLOCK = [8, 8]


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe", "deepseek-v3"])
def checkpoint(request, tmp_path_factory):
    """(fp8 checkpoint, transformers' model loaded from it: dequantized on the CPU)."""
    root = tmp_path_factory.mktemp(request.param)
    write_family_checkpoint(request.param, root / "float")
    write_fp8_checkpoint(root / "float", root / "fp8", BLOCK)
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "fp8", dtype=torch.float32)
    return root / "fp8", hf.eval()


def test_weights_equal_transformers_dequantized(checkpoint):
    """Layer 0's attention projections kept fp8, equal to transformers' dequantized weights;
    latent attention's kv_b_proj, absorbed into the queries and outputs, dequantized (the
    projections whose RoPE rows the loader reorders are checked through the logits)."""
    path, hf = checkpoint
    loaded = load_model(path, dtype=jnp.float32, load_tokenizer=False)
    attn = loaded.model.layers[0].self_attn
    theirs = hf.model.layers[0].self_attn
    names = ("q_proj", "k_proj", "o_proj")
    if loaded.config.latent_attention is not None:
        names = ("q_a_proj", "o_proj")
        kv_b = attn.kv_b_proj.get_value()
        assert not isinstance(kv_b, QArray)
        np.testing.assert_array_equal(np.asarray(kv_b).T, theirs.kv_b_proj.weight.detach().numpy())
    for name in names:
        w = getattr(attn, name).get_value()
        assert isinstance(w, QArray) and w.fmt == "fp8", name
        ref = getattr(theirs, name).weight.detach().numpy()
        ours = dequantize_np(w).reshape(-1, ref.shape[1])  # [O, I], our k/v heads as theirs
        np.testing.assert_array_equal(ours[: ref.shape[0]], ref, err_msg=name)


def test_experts_kept_fp8_equal_transformers_dequantized(checkpoint):
    """With quantization fp8 (the default on accelerators) a mixture of experts' projections
    stay fp8 (`FP8Experts`, dequantized inside the step), each expert equal to transformers'
    dequantized one; with float they are dequantized at load."""
    path, hf = checkpoint
    layer = next((i for i, m in enumerate(hf.model.layers) if hasattr(m.mlp, "experts")), None)
    if layer is None:
        pytest.skip("a dense model")
    loaded = load_model(path, dtype=jnp.float32, load_tokenizer=False, quantization="fp8")
    moe = loaded.model.layers[layer].mlp
    theirs = hf.model.layers[layer].mlp.experts
    gate_up = theirs.gate_up_proj.detach().numpy()  # [E, 2F, D]
    expected = dict(zip(("gate_proj", "up_proj"), np.split(gate_up, 2, axis=1), strict=True))
    expected["down_proj"] = theirs.down_proj.detach().numpy()  # [E, D, F]
    for name, ref in expected.items():
        w = getattr(moe, name).get_value()
        assert isinstance(w, FP8Experts), name
        ours = np.asarray(dequantize_experts(w, jnp.float32))  # [E, O, I] as stored
        np.testing.assert_array_equal(ours, ref, err_msg=name)
    floats = load_model(path, dtype=jnp.float32, load_tokenizer=False, quantization="float")
    assert not isinstance(floats.model.layers[layer].mlp.gate_proj.get_value(), FP8Experts)


def test_logits_and_greedy_tokens_equal_transformers(checkpoint):
    path, hf = checkpoint
    loaded = load_model(path, dtype=jnp.float32, load_tokenizer=False)
    ids = np.random.default_rng(2).integers(3, VOCAB, size=40).tolist()
    ours = prefill_logits(loaded.model, loaded.config, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - ref).max() < 1e-3 * max(1.0, np.abs(ref).max())

    prompts = [ids, ids[5:27]]
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10
            )
        expected.append(out[0, len(p) :].tolist())
    for quantization in (None, "fp8"):  # vLLM's spelling keeps the checkpoint as it is
        llm = LLM(
            path, dtype="float32", quantization=quantization, page_size=8, num_pages=48,
            max_num_seqs=2, max_num_batched_tokens=16, max_model_len=128, skip_warmup=True,
        )  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected, quantization


def test_kept_fp8_equals_its_dequantized_weights(tmp_path):
    """DeepSeek-V3 in FP8 blocks of 8 x 8 served as shipped (layers and experts kept fp8,
    dequantized inside the step): its logits equal the dequantized checkpoint's within float
    tolerance. (The format's own error, measured as perplexity on the demo model's trained
    weights: benchmarks/fp8_blocks_quality.py.)"""
    write_family_checkpoint("deepseek-v3", tmp_path / "float")
    write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", BLOCK)
    kw = dict(dtype=jnp.float32, load_tokenizer=False)
    kept = load_model(tmp_path / "fp8", quantization="fp8", **kw)
    dequantized = load_model(tmp_path / "fp8", quantization="float", **kw)
    assert isinstance(kept.model.layers[1].mlp.gate_proj.get_value(), FP8Experts)
    assert isinstance(kept.model.layers[1].self_attn.q_b_proj.get_value(), QArray)
    assert not isinstance(dequantized.model.layers[1].self_attn.q_b_proj.get_value(), QArray)
    ids = np.random.default_rng(4).integers(3, VOCAB, size=48).tolist()
    ours = prefill_logits(kept.model, kept.config, ids)
    ref = prefill_logits(dequantized.model, dequantized.config, ids)
    assert np.abs(ours - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())


def test_blocks_become_exact_groups():
    """Groups of gcd(block, row) inputs, each inside one block: every weight is its value times
    its block's factor, partial blocks included; a per-tensor factor without a block size."""
    rng = np.random.default_rng(0)
    for (o, i), block in [((96, 64), [32, 48]), ((48, 256), [128, 128]), ((130, 384), [128, 128])]:
        q = rng.normal(size=(o, i)).astype(ml_dtypes.float8_e4m3fn)
        scale = rng.uniform(0.01, 1, size=(-(-o // block[0]), -(-i // block[1]))).astype(np.float32)
        w = fp8_blocks(q, scale, block)
        rows = np.arange(o)[:, None] // block[0]
        cols = np.arange(i)[None, :] // block[1]
        np.testing.assert_array_equal(dequantize_np(w), q.astype(np.float32) * scale[rows, cols])
    w = fp8_blocks(q, np.float32(0.5), None)
    np.testing.assert_array_equal(dequantize_np(w), q.astype(np.float32) * 0.5)
    with pytest.raises(ValueError, match=r"expected \[2, 3\]"):
        fp8_blocks(q, np.ones((1, 3), np.float32), [128, 128])


def test_ue8m0_factors(tmp_path):
    """Power-of-two factors stored as float8_e8m0fnu (DeepSeek-V3.1's `scale_fmt: ue8m0`)
    read as the same weights transformers dequantizes."""
    write_family_checkpoint("qwen3", tmp_path / "float", tokenizer=False)
    write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", BLOCK, ue8m0=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32)
    loaded = load_model(tmp_path / "fp8", dtype=jnp.float32, load_tokenizer=False)
    w = loaded.model.layers[1].mlp.down_proj.get_value()
    ref = hf.model.layers[1].mlp.down_proj.weight.detach().numpy()
    assert isinstance(w, QArray) and w.fmt == "fp8"
    np.testing.assert_array_equal(dequantize_np(w), ref)

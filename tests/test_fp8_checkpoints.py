"""Fine-grained FP8 checkpoints (`quant_method: fp8`, as DeepSeek-V3 and the "-FP8" releases of
Qwen3 and others ship): float8 e4m3 weights with a float32 factor per block of
`weight_block_size`. Tiny random checkpoints quantized here are loaded by transformers (which
dequantizes them on the CPU) and by us, kept fp8: the same weights exactly, the same logits,
and the same greedy tokens, chunked and batched."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.loaders import load_model
from jaxllm.loaders.quantized_hf import fp8_blocks
from jaxllm.quantization import QArray, dequantize_np

from helpers import VOCAB, prefill_logits, write_family_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FP8_MAX = 448.0
# Blocks dividing every tiny weight (several per weight): transformers' CPU dequantizer
# derives the block from the scale grid (rows // grid rows), which equals the format's ceil
# grid only where blocks divide; partial last blocks (DeepSeek-V3's 576-row kv_a_proj) are
# checked against the format's rule in test_blocks_become_exact_groups.
BLOCK = [8, 8]


def _fp8_checkpoint(src: Path, dst: Path, block: list[int], *, ue8m0: bool = False) -> None:
    """`src` with every linear layer's weight in fp8 e4m3, one factor per block, as
    transformers' FineGrainedFP8Config writes it (weight_scale_inv multiplies); with `ue8m0`
    the factors are powers of two stored as float8_e8m0fnu (its `scale_fmt: ue8m0`)."""
    from safetensors.torch import load_file, save_file

    bo, bi = block
    out = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        linear = name.endswith("proj.weight") and w.ndim == 2
        if not linear:
            out[name] = w
            continue
        o, i = w.shape
        rows, cols = -(-o // bo), -(-i // bi)
        padded = torch.zeros(rows * bo, cols * bi)
        padded[:o, :i] = w.float()
        blocks = padded.reshape(rows, bo, cols, bi)
        scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # [rows, cols]
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        if ue8m0:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        q = (blocks / scale[:, None, :, None]).reshape(rows * bo, cols * bi)[:o, :i]
        out[name] = q.to(torch.float8_e4m3fn)
        stored = scale.to(torch.float8_e8m0fnu) if ue8m0 else scale.float()
        out[name.replace(".weight", ".weight_scale_inv")] = stored
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": block,
        **({"scale_fmt": "ue8m0"} if ue8m0 else {}),
    }
    (dst / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (dst / f.name).write_bytes(f.read_bytes())


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def checkpoint(request, tmp_path_factory):
    """(fp8 checkpoint, transformers' model loaded from it: dequantized on the CPU)."""
    root = tmp_path_factory.mktemp(request.param)
    write_family_checkpoint(request.param, root / "float")
    _fp8_checkpoint(root / "float", root / "fp8", BLOCK)
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "fp8", dtype=torch.float32)
    return root / "fp8", hf.eval()


def test_weights_equal_transformers_dequantized(checkpoint):
    path, hf = checkpoint
    loaded = load_model(path, dtype=jnp.float32, load_tokenizer=False)
    attn = loaded.model.layers[0].self_attn
    for name in ("q_proj", "k_proj", "o_proj"):
        w = getattr(attn, name).get_value()
        assert isinstance(w, QArray) and w.fmt == "fp8", name
        ref = getattr(hf.model.layers[0].self_attn, name).weight.detach().numpy()
        ours = dequantize_np(w).reshape(-1, ref.shape[1])  # [O, I], our k/v heads as theirs
        np.testing.assert_array_equal(ours[: ref.shape[0]], ref, err_msg=name)


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
    _fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", BLOCK, ue8m0=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32)
    loaded = load_model(tmp_path / "fp8", dtype=jnp.float32, load_tokenizer=False)
    w = loaded.model.layers[1].mlp.down_proj.get_value()
    ref = hf.model.layers[1].mlp.down_proj.weight.detach().numpy()
    assert isinstance(w, QArray) and w.fmt == "fp8"
    np.testing.assert_array_equal(dequantize_np(w), ref)

"""MXFP4 (gpt-oss's expert weights): the format's codec against transformers' own dequantizer,
and a tiny gpt-oss checkpoint whose experts are quantized here, loaded as shipped (blocks and
scales), against transformers running the same weights dequantized."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.loaders import load_model
from jaxllm.loaders.mxfp4 import E2M1_VALUES, dequantize, quantize

from helpers import VOCAB, prefill_logits, write_family_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_dequantize_matches_transformers():
    """Random codes and scales: the same floats, in the same [E, in, out] layout, as
    transformers' `convert_moe_packed_tensors`."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 40, 4, 16), dtype=np.uint8)  # [E, out, in/32, 16]
    scales = rng.integers(117, 137, size=(3, 40, 4), dtype=np.uint8)
    theirs = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    ).numpy()
    ours = np.swapaxes(dequantize(blocks, scales), -1, -2)
    np.testing.assert_array_equal(ours, theirs)


def test_quantize_round_trips_and_rounds_to_nearest():
    rng = np.random.default_rng(1)
    # Values already on the grid of their block come back exactly.
    codes = rng.integers(0, 16, size=(5, 64))
    codes[:, 0], codes[:, 32] = 7, 15  # +-6: every block's largest magnitude sets its scale
    exact = E2M1_VALUES[codes] * np.ldexp(1.0, rng.integers(-8, 8, size=(5, 2))).repeat(32, 1)
    np.testing.assert_array_equal(dequantize(*quantize(exact)), exact.astype(np.float32))
    # Random values: within half a grid step (at most one scale unit: the grid's step is 2
    # between 4 and 6), none clipped, zeros stay zero.
    w = rng.normal(size=(4, 96)).astype(np.float32)
    w[0, :32] = 0.0
    blocks, scales = quantize(w)
    back = dequantize(blocks, scales)
    scale = np.ldexp(1.0, scales.astype(np.int32) - 127).repeat(32, axis=-1)
    assert np.all(np.abs(back - w) <= scale + 1e-7)
    assert np.all(back[0, :32] == 0)
    # A transposed view quantizes to C-ordered arrays (safetensors writes memory as it lies).
    assert all(a.flags.c_contiguous for a in quantize(w.T.copy().T))
    # And the nearest value of its block's grid, by brute force over the 16 codes.
    best = np.abs(E2M1_VALUES * scale[..., None] - w[..., None]).min(axis=-1)
    np.testing.assert_allclose(np.abs(back - w), best, atol=1e-7)


def _mxfp4_checkpoint(src, dst, hf_model):
    """`src` (a float gpt-oss checkpoint written by transformers) with its experts in MXFP4, as
    gpt-oss ships them, at `dst`; `hf_model` gets the dequantized weights (its reference)."""
    from safetensors.numpy import save_file

    tensors = {}
    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    for name, w in state.items():
        stem = name.rsplit(".", 1)[-1]
        if stem in ("gate_up_proj", "down_proj") and ".experts." in name:
            blocks, scales = quantize(np.swapaxes(w, -1, -2))  # [E, out, in] along in
            blocks = blocks.reshape(*scales.shape, 16)
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            back = np.swapaxes(dequantize(blocks, scales), -1, -2)
            hf_model.get_parameter(name).data.copy_(torch.from_numpy(back))
        else:
            tensors[name] = w
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (dst / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    float_model = write_family_checkpoint("gpt-oss", root / "float")
    quantized_model = write_family_checkpoint("gpt-oss", root / "float-copy")
    _mxfp4_checkpoint(root / "float", root / "mxfp4", quantized_model)
    return root, float_model, quantized_model


def test_a_checkpoint_loads_as_shipped(checkpoints):
    """Blocks and scales become the experts' float weights: equal to transformers'
    dequantized ones, and the greedy tokens equal transformers' on them."""
    root, _, hf_model = checkpoints
    loaded = load_model(root / "mxfp4", dtype=jnp.float32, load_tokenizer=False)
    mlp = loaded.model.layers[1].mlp
    gate_up = hf_model.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()
    np.testing.assert_array_equal(np.asarray(mlp.gate_proj.get_value()), gate_up[..., 0::2])
    np.testing.assert_array_equal(np.asarray(mlp.up_proj.get_value()), gate_up[..., 1::2])

    ids = np.random.default_rng(3).integers(3, VOCAB, size=40).tolist()
    with torch.no_grad():
        expected = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=24, do_sample=False, min_new_tokens=24
        )[0, len(ids) :].tolist()
    llm = LLM(
        root / "mxfp4", dtype="float32", page_size=8, num_pages=32, max_num_seqs=2,
        max_num_batched_tokens=16, max_model_len=128, skip_warmup=True,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected


def test_perplexity_within_two_percent_of_float(checkpoints):
    """On text the float model wrote itself (sampled), the MXFP4 experts' perplexity is within
    2% of the float weights'."""
    root, float_model, _ = checkpoints
    torch.manual_seed(0)
    with torch.no_grad():
        text = float_model.generate(
            torch.tensor([[5, 9, 13]]), max_new_tokens=200, do_sample=True, top_k=0
        )[0].tolist()

    def perplexity(path) -> float:
        loaded = load_model(path, dtype=jnp.float32, load_tokenizer=False)
        logits = prefill_logits(loaded.model, loaded.config, text)[:-1]
        logp = (
            logits
            - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))[:, None]
            - logits.max(-1, keepdims=True)
        )
        return float(np.exp(-logp[np.arange(len(text) - 1), text[1:]].mean()))

    ppl_float, ppl_mxfp4 = perplexity(root / "float"), perplexity(root / "mxfp4")
    print(f"perplexity: float {ppl_float:.3f}, mxfp4 {ppl_mxfp4:.3f}")
    assert ppl_mxfp4 != ppl_float
    assert abs(ppl_mxfp4 / ppl_float - 1) < 0.02

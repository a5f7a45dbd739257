"""MXFP4 (gpt-oss's expert weights): the format's codec against transformers' own dequantizer,
and a tiny gpt-oss checkpoint whose experts are quantized here, loaded as shipped (blocks and
scales, dequantized at load or kept 4-bit and dequantized inside the step), against
transformers running the same weights dequantized."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm import LLM, SamplingParams
from jaxllm.loaders import load_model, mxfp4_kept
from jaxllm.loaders.mxfp4 import E2M1_VALUES, dequantize, quantize
from jaxllm.quantization import MXFP4Experts, dequantize_half

from helpers import VOCAB, prefill_logits, tensor_parallel_report, write_family_checkpoint

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
    """Blocks and scales become the experts' float weights (the CPU's default): equal to
    transformers' dequantized ones, and the greedy tokens equal transformers' on them."""
    root, _, hf_model = checkpoints
    assert not mxfp4_kept(None)  # this CPU; kept by default on TPU and GPU
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


def _dequantized(w: MXFP4Experts, dtype) -> np.ndarray:
    """[E, I, O]: the float weights `w` stands for, from the step's two halves."""
    even, odd = (np.asarray(dequantize_half(w, dtype, odd=odd)) for odd in (False, True))
    e, o, half = even.shape
    return np.stack([even, odd], axis=-1).reshape(e, o, 2 * half).transpose(0, 2, 1)


def _greedy(hf_model, ids, n=24) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
    return out[0, len(ids) :].tolist()


def test_kept_experts_equal_their_dequantized_weights(checkpoints):
    """`quantization="mxfp4"` keeps the experts 4-bit on the device (4.25 bits a weight):
    dequantized inside the step they are exactly the weights dequantized at load, in float32
    and in bfloat16; the logits equal that model's to float tolerance, and the greedy tokens
    transformers', chunked and batched."""
    root, _, hf_model = checkpoints
    kept = load_model(root / "mxfp4", dtype=jnp.float32, load_tokenizer=False, quantization="mxfp4")
    whole = load_model(root / "mxfp4", dtype=jnp.float32, load_tokenizer=False)
    for name in ("gate_proj", "up_proj", "down_proj"):
        w = getattr(kept.model.layers[1].mlp, name).get_value()
        ref = np.asarray(getattr(whole.model.layers[1].mlp, name).get_value())
        assert isinstance(w, MXFP4Experts) and w.codes.dtype == jnp.uint8
        assert w.shape == ref.shape
        assert w.nbytes * 8 == ref.size * 4.25  # 4 bits a value, 8 a scale per 32
        np.testing.assert_array_equal(_dequantized(w, jnp.float32), ref)
        bf16 = _dequantized(w, jnp.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(bf16, ref)  # every MXFP4 value is a bfloat16
    ids = np.random.default_rng(4).integers(3, VOCAB, size=48).tolist()
    a = prefill_logits(kept.model, kept.config, ids)
    b = prefill_logits(whole.model, whole.config, ids)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)

    prompts = [ids[:40], ids[8:], ids[:17]]
    llm = LLM(
        root / "mxfp4", dtype="float32", quantization="mxfp4", page_size=8, num_pages=48,
        max_num_seqs=3, max_num_batched_tokens=16, max_model_len=128,
    )  # fmt: skip
    experts = [
        v.get_value() for path, v in nnx.to_flat_state(llm.runner.state) if path[-1] == "up_proj"
    ]
    assert experts and all(isinstance(w, MXFP4Experts) for w in experts)
    before = llm.runner.num_compilations
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [_greedy(hf_model, p) for p in prompts]
    assert llm.runner.num_compilations == before


@pytest.mark.slow
def test_kept_experts_under_expert_parallelism(checkpoints, tmp_path):
    """1, 2 and 4 fake CPU devices: the same greedy tokens, nothing compiled after warmup,
    each device holding its quarter of the 4-bit experts."""
    root, _, _ = checkpoints
    rows = tensor_parallel_report(root / "mxfp4", "1,2,4", tmp_path, "--quantization", "mxfp4")
    assert [r["same_tokens_as_first"] for r in rows] == [True] * 3
    assert [r["compiled_after_warmup"] for r in rows] == [0] * 3
    whole = rows[0]["expert_bytes"]
    assert [r["expert_bytes_per_device"] for r in rows] == [whole, whole // 2, whole // 4]


@pytest.mark.parametrize("quantization", [None, "mxfp4"])
def test_perplexity_within_two_percent_of_float(checkpoints, quantization):
    """On text the float model wrote itself (sampled), the MXFP4 experts' perplexity, as
    dequantized at load or kept 4-bit, is within 2% of the float weights'."""
    root, float_model, _ = checkpoints
    torch.manual_seed(0)
    with torch.no_grad():
        text = float_model.generate(
            torch.tensor([[5, 9, 13]]), max_new_tokens=200, do_sample=True, top_k=0
        )[0].tolist()

    def perplexity(path, quantization=None) -> float:
        loaded = load_model(
            path, dtype=jnp.float32, load_tokenizer=False, quantization=quantization
        )
        logits = prefill_logits(loaded.model, loaded.config, text)[:-1]
        logp = (
            logits
            - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))[:, None]
            - logits.max(-1, keepdims=True)
        )
        return float(np.exp(-logp[np.arange(len(text) - 1), text[1:]].mean()))

    ppl_float, ppl_mxfp4 = perplexity(root / "float"), perplexity(root / "mxfp4", quantization)
    print(f"perplexity: float {ppl_float:.3f}, mxfp4 {ppl_mxfp4:.3f}")
    assert ppl_mxfp4 != ppl_float
    assert abs(ppl_mxfp4 / ppl_float - 1) < 0.02

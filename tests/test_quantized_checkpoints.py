"""GPTQ, AWQ and compressed-tensors checkpoints (jaxllm/loaders/quantized_hf.py).

Each format is written here from a tiny float model with the packing its own writer uses
(AutoGPTQ's `QuantLinear.pack`, AutoAWQ's `WQLinear_GEMM.from_linear`, compressed-tensors'
`pack_to_int32`), restated as plain loops over integers. The reference libraries need CUDA
builds of torch and are not installed here, so the check is against these restatements: the
loaded weights equal a numpy reading of the format, and the model built from them gives the
logits of a float checkpoint holding the same dequantized weights.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxllm.config import REFERENCE_KERNELS
from jaxllm.loaders import quantized_hf
from jaxllm.quantization import QArray, dequantize_np

from helpers import prefill_logits

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _rtn(w: np.ndarray, group: int, bits: int, rng, sym: bool):
    """Round-to-nearest integers q [O, I], zeros z [O, G] and scales s [O, G] (float16)."""
    o, i = w.shape
    g = w.reshape(o, i // group, group)
    top = (1 << bits) - 1
    if sym:
        s = (np.abs(g).max(-1) / (top // 2)).astype(np.float16)
        z = np.full(s.shape, (top + 1) // 2)
    else:
        lo, hi = g.min(-1), g.max(-1)
        s = ((hi - lo) / top).astype(np.float16)
        z = np.clip(np.rint(-lo / s.astype(np.float32)), 1, top).astype(np.int64)  # v1: z >= 1
    sf = s.astype(np.float32)[..., None]
    q = np.clip(np.rint(g / sf) + z[..., None], 0, top).astype(np.int64).reshape(o, i)
    return q, z, s


def _pack_gptq_rows(intweight: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ: qweight[row] |= intweight[j] << (bits * (j - i)) for 32 / bits rows j."""
    per = 32 // bits
    out = np.zeros((intweight.shape[0] // per, intweight.shape[1]), np.uint32)
    for row in range(out.shape[0]):
        for j in range(per):
            out[row] |= intweight[row * per + j].astype(np.uint32) << np.uint32(bits * j)
    return out.view(np.int32)


def _pack_cols(intweight: np.ndarray, bits: int, order=None) -> np.ndarray:
    per = 32 // bits
    order = order or list(range(per))
    out = np.zeros((intweight.shape[0], intweight.shape[1] // per), np.uint32)
    for col in range(out.shape[1]):
        for k in range(per):
            column = intweight[:, col * per + order[k]].astype(np.uint32)
            out[:, col] |= column << np.uint32(bits * k)
    return out.view(np.int32)


def _write(src, dst, tensors: dict, quantization_config: dict | None):
    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _convert(src, tmp_path, method: str, *, act_order=False, bits=4, group=32, sym=False):
    """(quantized checkpoint, float checkpoint of the same dequantized weights, {module:
    dequantized [O, I]} read from the packed tensors with plain numpy)."""
    rng = np.random.default_rng(0)
    tensors = load_file(str(src / "model.safetensors"))
    quant, dense, expect = {}, {}, {}
    for name, w in tensors.items():
        prefix = name.removesuffix(".weight")
        if prefix.rpartition(".")[2] not in LINEARS:
            quant[name] = dense[name] = w
            continue
        o, i = w.shape
        if method == "compressed-int8":
            s = (np.abs(w).max(1, keepdims=True) / 127).astype(np.float32)
            q = np.clip(np.rint(w / s), -127, 127).astype(np.int8)
            quant[name], quant[prefix + ".weight_scale"] = q, s.astype(ml_dtypes.bfloat16)
            deq = q.astype(np.float32) * s.astype(ml_dtypes.bfloat16).astype(np.float32)
        elif method == "compressed-fp8":
            s = (np.abs(w).max(1, keepdims=True) / 448).astype(np.float32)
            q = (w / s).astype(ml_dtypes.float8_e4m3fn)
            quant[name], quant[prefix + ".weight_scale"] = q, s
            deq = q.astype(np.float32) * s
        elif method == "compressed-int4":
            q, z, s = _rtn(w, group, 4, rng, sym=True)  # stored as q - 8 + 8: unsigned
            quant[prefix + ".weight_packed"] = _pack_gptq_rows(q.T, 4).T.copy()
            quant[prefix + ".weight_scale"] = s
            quant[prefix + ".weight_shape"] = np.asarray([o, i], np.int64)
            deq = (q - 8).reshape(o, i // group, group) * s.astype(np.float32)[..., None]
            deq = np.ascontiguousarray(deq.reshape(o, i), np.float32)
        else:
            g_idx = np.arange(i) // group
            if act_order:
                g_idx = rng.permutation(g_idx)
            # Quantize with each input row's own group (act-order: rows scattered).
            order = np.argsort(g_idx, kind="stable")
            q_sorted, z, s = _rtn(w[:, order], group, bits, rng, sym=sym)
            q = np.empty_like(q_sorted)
            q[:, order] = q_sorted
            sf = s.astype(np.float32)
            deq = sf[:, g_idx] * (q - z[:, g_idx])  # [O, I]: s * (q - z), row i's group
            if method == "gptq":
                quant[prefix + ".qweight"] = _pack_gptq_rows(q.T, bits)
                quant[prefix + ".qzeros"] = _pack_cols((z - 1).T, bits)  # v1 stores z - 1
                quant[prefix + ".scales"] = s.T.copy()
                quant[prefix + ".g_idx"] = g_idx.astype(np.int32)
            else:  # awq
                quant[prefix + ".qweight"] = _pack_cols(q.T, bits, [0, 2, 4, 6, 1, 3, 5, 7])
                quant[prefix + ".qzeros"] = _pack_cols(z.T, bits, [0, 2, 4, 6, 1, 3, 5, 7])
                quant[prefix + ".scales"] = s.T.copy()
            deq = np.ascontiguousarray(deq, np.float32)  # safetensors writes C order
        dense[name] = deq
        expect[name] = deq
    qc = {
        "gptq": {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm"},
    }.get(method, {"quant_method": "compressed-tensors"})
    q_dir = _write(src, tmp_path / method, quant, qc)
    d_dir = _write(src, tmp_path / f"{method}-dense", dense, None)
    return q_dir, d_dir, expect


CASES = {
    "gptq": dict(method="gptq"),
    "gptq-act-order": dict(method="gptq", act_order=True),
    "gptq-sym": dict(method="gptq", sym=True, group=64),
    "gptq-8bit": dict(method="gptq", bits=8),
    "gptq-groups-of-16": dict(method="gptq", group=16),  # finer than int4's blocks: int8
    "awq": dict(method="awq"),
    "compressed-int8": dict(method="compressed-int8"),
    "compressed-fp8": dict(method="compressed-fp8"),
    "compressed-int4": dict(method="compressed-int4"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_loads_as_written(tiny_model_dir, tmp_path, case):
    from jaxllm.loaders import hf as hf_loader
    from jaxllm.loaders import load_model

    q_dir, d_dir, expect = _convert(tiny_model_dir, tmp_path, **CASES[case])
    config = json.loads((q_dir / "config.json").read_text())
    method = quantized_hf.checkpoint_method(config)
    grouped = dict(
        quantized_hf.group_quantized(
            hf_loader.iter_safetensors(q_dir), method, config["quantization_config"]
        )
    )
    for name, want in expect.items():
        assert isinstance(grouped[name], QArray), name
        np.testing.assert_array_equal(dequantize_np(grouped[name]), want, err_msg=name)
    if CASES[case].get("act_order"):
        assert grouped["model.layers.0.self_attn.q_proj.weight"].perm is not None

    dense = load_model(d_dir, load_tokenizer=False)
    tokens = list(range(3, 40))
    want = prefill_logits(dense.model, dense.config, tokens)
    # Exactly the written weights: through XLA's dequantization. The platform's kernel (on
    # the CPU its integer path rounds activations to int8) is checked to that rounding's error.
    for backend, rtol, atol in (("xla", 1e-4, 1e-4), ("auto", 0, 2e-2)):
        compilation = dataclasses.replace(REFERENCE_KERNELS, quant_matmul_backend=backend)
        quant = load_model(q_dir, load_tokenizer=False, compilation=compilation)
        got = prefill_logits(quant.model, quant.config, tokens)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * np.abs(want).max())


def test_wrong_or_unknown_quantization_is_a_clear_error(tiny_model_dir, tmp_path):
    from jaxllm.loaders import load_model

    with pytest.raises(ValueError, match="quantization gptq does not match"):
        load_model(tiny_model_dir, load_tokenizer=False, quantization="gptq")
    bnb = _write(
        tiny_model_dir,
        tmp_path / "bnb",
        load_file(str(tiny_model_dir / "model.safetensors")),
        {"quant_method": "bitsandbytes"},
    )
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported"):
        load_model(bnb, load_tokenizer=False)
    q_dir, _, _ = _convert(tiny_model_dir, tmp_path, "awq")
    config = json.loads((q_dir / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (q_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="AWQ version 'gemv' is not supported"):
        load_model(q_dir, load_tokenizer=False)

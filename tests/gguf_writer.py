"""A small stand-in for llama.cpp's `convert_hf_to_gguf.py`, so the GGUF loader is tested on
files laid out like real ones without a download.

`write_gguf` writes a Hugging Face checkpoint directory (config.json, model.safetensors and,
if present, a byte-level BPE tokenizer.json) as GGUF with the `gguf` package, doing what
llama.cpp's converter does per architecture: tensor names from the `gguf` package's own
name map (the one the converter uses), Q/K rows permuted for llama, norm weights stored as
1 + w for gemma3, Llama 3.1's rope scaling written as a `rope_freqs` tensor, 1-D tensors kept
in F32 and the rest in the type asked for. Mixtures of experts go as llama.cpp's MoE
converters write them (`_experts`): each projection of every expert stacked in one
[E, out, in] tensor, fused gate_up tensors split (gpt-oss's interleaved, Llama 4's halves),
gpt-oss's MXFP4 blocks repacked into ggml's MXFP4 type. It returns what a correct loader must
give back: the stored (dequantized) tensors, in Hugging Face layout, under their Hugging Face
names (stacked experts input-major under the loader's `*_stacked` names).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from conftest import CHATML

Q = gguf.GGMLQuantizationType


@dataclasses.dataclass(frozen=True)
class Layout:
    arch: gguf.MODEL_ARCH
    permute_qk: bool = False  # llama.cpp's LlamaModel permutes the Q/K rows
    norm_shift: float = 0.0  # Gemma3Model stores every "*norm.weight" as w + 1


LAYOUTS = {
    "LlamaForCausalLM": Layout(gguf.MODEL_ARCH.LLAMA, permute_qk=True),
    "MixtralForCausalLM": Layout(gguf.MODEL_ARCH.LLAMA, permute_qk=True),
    "Qwen3ForCausalLM": Layout(gguf.MODEL_ARCH.QWEN3),
    "Qwen3MoeForCausalLM": Layout(gguf.MODEL_ARCH.QWEN3MOE),
    "Gemma3ForCausalLM": Layout(gguf.MODEL_ARCH.GEMMA3, norm_shift=1.0),
    "GptOssForCausalLM": Layout(gguf.MODEL_ARCH.GPT_OSS),
    "Llama4ForCausalLM": Layout(gguf.MODEL_ARCH.LLAMA4),
    "Gemma4ForCausalLM": Layout(gguf.MODEL_ARCH.GEMMA4),
}

# A sentencepiece-style vocabulary for checkpoints without tokenizer.json, Gemma's specials
# first in Gemma's order (pad 0, eos 1, bos 2, unk 3).
SPM_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permute of Q/K rows."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama_cpp_permute_inverse(w: np.ndarray, num_heads: int) -> np.ndarray:
    return (
        w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def rope_parameters(config: dict) -> dict:
    """The (global) RoPE parameters of a config.json, in either transformers spelling."""
    rope = dict(config.get("rope_parameters") or {})
    rope = dict(rope.get("full_attention", rope))
    rope.update(config.get("rope_scaling") or {})
    if "rope_theta" in config:
        rope["rope_theta"] = config["rope_theta"]
    return rope


def llama3_rope_factors(config: dict) -> np.ndarray:
    """llama.cpp's `LlamaModel.generate_extra_tensors`: Llama 3.1's scaling as divisors."""
    rope = rope_parameters(config)
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(
    hf_dir: Path,
    out: Path,
    linear_type: Q = Q.F32,
    *,
    arch: str | None = None,
    norm_type: Q = Q.F32,
    embed_type: Q = Q.Q8_0,
    expert_type: Q | None = None,
    edit: Callable[[gguf.GGUFWriter], None] | None = None,
) -> dict[str, np.ndarray]:
    """Converts a tiny HF checkpoint to GGUF; returns the expected dequantized HF tensors.
    Float experts are stored as `expert_type` (default: `linear_type`); MXFP4 ones as MXFP4.

    `arch` overrides the `general.architecture` written (the layout stays the checkpoint's);
    `edit` may add metadata before the tensors are written."""
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    layout = LAYOUTS[config["architectures"][0]]
    name = gguf.MODEL_ARCH_NAMES[layout.arch]
    n, k = config["num_attention_heads"], config.get("num_key_value_heads") or 0
    rope = rope_parameters(config)
    w = gguf.GGUFWriter(str(out), arch or name)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_head_count(n)
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if layout.arch == gguf.MODEL_ARCH.GEMMA4:
        _add_gemma4_metadata(w, config)
    else:
        # Llama4Model: the dense layers' width (an expert's is expert_feed_forward_length).
        w.add_feed_forward_length(
            config.get("intermediate_size_mlp") or config["intermediate_size"]
        )
        w.add_head_count_kv(k or n)
        if config.get("head_dim"):  # TextModel.set_gguf_parameters
            w.add_key_length(config["head_dim"])
            w.add_value_length(config["head_dim"])
    if layout.arch in (gguf.MODEL_ARCH.GEMMA3, gguf.MODEL_ARCH.GEMMA4):
        w.add_sliding_window(config["sliding_window"])  # and no vocab_size, as llama.cpp
    else:
        w.add_vocab_size(config["vocab_size"])
    _add_expert_metadata(w, layout.arch, config)
    if layout.arch == gguf.MODEL_ARCH.LLAMA4 and config.get("attention_chunk_size") is None:
        w.add_sliding_window(0)  # Llama4Model, for all-full-attention layer types (MobileLLM)
    if rope.get("rope_type") == "yarn":  # TextModel.set_gguf_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    _add_tokenizer(w, hf_dir, config["vocab_size"])
    if edit is not None:
        edit(w)

    expected = {}
    names = gguf.get_tensor_name_map(layout.arch, config["num_hidden_layers"])

    def put(gguf_name: str, arr: np.ndarray, qtype: Q, heads: int | None = None) -> np.ndarray:
        stored = llama_cpp_permute(arr, heads) if heads else arr
        if qtype == Q.F32:
            data = stored.astype(np.float32)
            w.add_tensor(gguf_name, data)
            deq = data
        else:
            try:
                data = gguf.quants.quantize(stored.astype(np.float32), qtype)
            except gguf.QuantError:  # rows the type's blocks do not divide: F16, as llama.cpp
                qtype = Q.F16
                data = gguf.quants.quantize(stored.astype(np.float32), qtype)
            w.add_tensor(gguf_name, data, raw_dtype=qtype)
            deq = gguf.quants.dequantize(data, qtype).reshape(stored.shape)
        return llama_cpp_permute_inverse(deq, heads) if heads else deq

    if rope.get("rope_type") == "llama3":
        put("rope_freqs.weight", llama3_rope_factors(config), Q.F32)
    if rope.get("rope_type") == "proportional":  # Gemma4Model.generate_extra_tensors
        full_layer = next(iter(config["per_layer_config"].values()))
        head_dim = config.get("global_head_dim") or full_layer["head_dim"]
        half, turning = head_dim // 2, int(head_dim * rope["partial_rotary_factor"] / 2)
        factors = np.array([1.0] * turning + [1e30] * (half - turning), np.float32)
        put("rope_freqs.weight", factors, Q.F32)
    for gguf_name, ours, arr in _experts(layout.arch, config, tensors):
        if arr.dtype == np.uint8:  # MXFP4 bytes, [E, out, in / 32 * 17]
            w.add_tensor(gguf_name, arr, raw_dtype=Q.MXFP4)
            deq = gguf.quants.dequantize(arr, Q.MXFP4)
        else:
            deq = put(gguf_name, arr, Q.F32 if arr.ndim == 1 else expert_type or linear_type)
        expected[ours] = deq.transpose(0, 2, 1) if ours.endswith("_stacked") else deq
    for hf_name, arr in tensors.items():
        if llama4 := layout.arch == gguf.MODEL_ARCH.LLAMA4:
            hf_name = hf_name.replace(".feed_forward.", ".mlp.")  # the loader's names
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base.replace('.mlp.', '.feed_forward.') if llama4 else base)}.{suffix}"
        arr = arr.astype(np.float32)
        is_norm = hf_name.endswith("norm.weight")
        if is_norm:
            arr = arr + layout.norm_shift
        if "embed_tokens" in hf_name or hf_name == "lm_head.weight":
            qtype = embed_type
        else:
            qtype = norm_type if arr.ndim == 1 else linear_type
        heads = None
        if layout.permute_qk and "q_proj.weight" in hf_name:
            heads = n
        elif layout.permute_qk and "k_proj.weight" in hf_name:
            heads = k or n
        if gguf_name.endswith("ffn_gate_inp.weight"):
            qtype = Q.F32  # the converter keeps routers in F32
        deq = put(gguf_name, arr, qtype, heads)
        hf_name = hf_name.replace(".block_sparse_moe.gate.", ".mlp.gate.")  # Mixtral's router
        expected[hf_name] = deq - layout.norm_shift if is_norm else deq
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _add_tokenizer(w: gguf.GGUFWriter, hf_dir: Path, vocab_size: int) -> None:
    """The checkpoint's byte-level BPE tokenizer.json with ChatML, or a sentencepiece-style
    vocabulary of `vocab_size` made-up pieces (no chat template) when there is none."""
    if (hf_dir / "tokenizer.json").is_file():
        tok = json.loads((hf_dir / "tokenizer.json").read_text())
        vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
        tokens = [t for t, _ in vocab]
        tokens += [f"<unused{i}>" for i in range(vocab_size - len(vocab))]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
        merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML)
        return
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = SPM_SPECIALS + pieces
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0 if i < len(SPM_SPECIALS) else -float(i) for i in range(len(tokens))])
    w.add_token_types([3 if t.startswith("<") else 1 for t in tokens])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)


def _add_expert_metadata(w: gguf.GGUFWriter, arch: gguf.MODEL_ARCH, config: dict) -> None:
    """What TextModel, Qwen2MoeModel, GptOssModel and Llama4Model write about experts."""
    if config.get("num_local_experts"):  # TextModel
        w.add_expert_count(config["num_local_experts"])
    if config.get("num_experts_per_tok"):
        w.add_expert_used_count(config["num_experts_per_tok"])
    if arch == gguf.MODEL_ARCH.QWEN3MOE:
        if config.get("num_experts"):  # Qwen's own spelling
            w.add_expert_count(config["num_experts"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    elif arch == gguf.MODEL_ARCH.GPT_OSS:
        w.add_sliding_window(config["sliding_window"])
        w.add_expert_feed_forward_length(config["intermediate_size"])
    elif arch == gguf.MODEL_ARCH.LLAMA4:
        w.add_interleave_moe_layer_step(config["interleave_moe_layer_step"])
        w.add_expert_feed_forward_length(config["intermediate_size"])


def _add_gemma4_metadata(w: gguf.GGUFWriter, config: dict) -> None:
    """Gemma4Model.set_gguf_parameters (through Gemma3Model's): per-layer kinds, kv heads and
    MLP widths, both head widths, the shared-KV layers, the per-layer inputs."""
    rope = config["rope_parameters"]
    sliding = [t == "sliding_attention" for t in config["layer_types"]]
    # transformers 5 saves the full layers' widths as per_layer_config; Google's configs (and
    # the converter) name them so.
    full_layer = next(iter((config.get("per_layer_config") or {}).values()), None) or {}
    config = {
        **config,
        "global_head_dim": config.get("global_head_dim") or full_layer["head_dim"],
        "num_global_key_value_heads": config.get("num_global_key_value_heads")
        or full_layer.get("num_key_value_heads"),
    }
    layers, shared = config["num_hidden_layers"], config.get("num_kv_shared_layers") or 0
    if config.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(config.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(sliding)
    w.add_key_length(config["global_head_dim"])
    w.add_value_length(config["global_head_dim"])
    w.add_key_length_swa(config["head_dim"])
    w.add_value_length_swa(config["head_dim"])
    if config.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("num_experts"):  # TextModel (num_experts, top_k_experts)
        w.add_expert_count(config["num_experts"])
        w.add_expert_used_count(config["top_k_experts"])
    ff = config["intermediate_size"]
    if config.get("use_double_wide_mlp"):
        w.add_feed_forward_length([ff if i < layers - shared else 2 * ff for i in range(layers)])
    else:
        w.add_feed_forward_length(ff)
    swa, full = config["num_key_value_heads"], config.get("num_global_key_value_heads")
    w.add_head_count_kv([swa if s else full for s in sliding] if full is not None else swa)
    w.add_rope_dimension_count(config["global_head_dim"])
    w.add_rope_dimension_count_swa(config["head_dim"])


def _mxfp4_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """GptOssModel.repack_mxfp4: HF's MXFP4 (values 2k and 2k + 1 in byte k) as ggml's blocks
    of 17 bytes (the scale, then values j and j + 16 in byte j), [..., out, in / 32 * 17]."""
    values = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = values[..., :16] | (values[..., 16:] << 4)
    packed = np.concatenate([scales[..., None], qs], axis=-1).astype(np.uint8)
    return packed.reshape(*packed.shape[:-2], -1)


def _experts(
    arch: gguf.MODEL_ARCH, config: dict, tensors: dict[str, np.ndarray]
) -> list[tuple[str, str, np.ndarray]]:
    """The expert tensors as llama.cpp's converter writes them: (GGUF name, the loader's name,
    the stored array [E, out, in] or MXFP4 bytes), taken out of `tensors`; the router and
    the other tensors stay for the generic path (gpt-oss's sinks, named oddly, come here)."""
    out = []
    stacked = lambda layer, p: f"model.layers.{layer}.mlp.experts.{p}_proj_stacked"  # noqa: E731
    per_expert = re.compile(
        r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$"
    )
    names = {"w1": "gate", "w3": "up", "w2": "down"}
    groups: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name in list(tensors):
        if m := per_expert.match(name):  # Mixtral's, Qwen3-MoE's: stacked
            layer, expert, proj = int(m[1]), int(m[2]), m[3]
            proj = names.get(proj, proj.removesuffix("_proj"))
            groups.setdefault((layer, proj), {})[expert] = tensors.pop(name).astype(np.float32)
    for (layer, proj), by_expert in sorted(groups.items()):
        w = np.stack([by_expert[e] for e in sorted(by_expert)])
        out.append((f"blk.{layer}.ffn_{proj}_exps.weight", stacked(layer, proj), w))
    if arch == gguf.MODEL_ARCH.GEMMA4:  # Gemma4Model.modify_tensors' renames
        for name in list(tensors):
            layer = name.split(".")[2] if name.startswith("model.layers.") else None
            for tail, gguf_tail in (
                (".layer_scalar", "layer_output_scale.weight"),
                (".router.scale", "ffn_gate_inp.scale"),
                (".router.per_expert_scale", "ffn_down_exps.scale"),
                (".experts.gate_up_proj", "ffn_gate_up_exps.weight"),
                (".experts.down_proj", "ffn_down_exps.weight"),
            ):
                if layer is not None and name.endswith(tail):
                    out.append((f"blk.{layer}.{gguf_tail}", name, tensors.pop(name)))
        return out
    fused = re.compile(
        r"^model\.layers\.(\d+)\.(?:mlp|feed_forward)\.experts\.(gate_up|down)_proj(.*)$"
    )
    for name in list(tensors):
        if name.endswith(".self_attn.sinks"):
            layer = name.split(".")[2]
            out.append((f"blk.{layer}.attn_sinks.weight", name, tensors.pop(name)))
            continue
        m = fused.match(name)
        if m is None or m[3] == "_scales":
            continue
        layer, proj, rest = m[1], m[2], m[3]
        w = tensors.pop(name)
        if rest == "_blocks":  # gpt-oss's MXFP4: [E, out, in / 32, 16] with its scales
            scales = tensors.pop(name.replace("_blocks", "_scales"))
            if proj == "down":
                parts = {"down": (w, scales)}
            else:
                parts = {"gate": (w[:, 0::2], scales[:, 0::2]), "up": (w[:, 1::2], scales[:, 1::2])}
            for p, (b, sc) in parts.items():
                out.append(
                    (f"blk.{layer}.ffn_{p}_exps.weight", stacked(layer, p), _mxfp4_ggml(b, sc))
                )
            continue
        w = w.astype(np.float32)
        if rest == "_bias":  # gpt-oss's: [E, 2F] interleaved, [E, D]
            parts = {"down": w} if proj == "down" else {"gate": w[:, 0::2], "up": w[:, 1::2]}
            for p, b in parts.items():
                out.append((f"blk.{layer}.ffn_{p}_exps.bias", f"{stacked(layer, p)}_bias", b))
            continue
        w = w.transpose(0, 2, 1)  # input-major [E, in, out] -> [E, out, in]
        if proj == "down":
            parts = {"down": w}
        elif arch == gguf.MODEL_ARCH.GPT_OSS:  # gate and up interleaved
            parts = {"gate": w[:, 0::2], "up": w[:, 1::2]}
        else:  # Llama 4: halves
            half = w.shape[1] // 2
            parts = {"gate": w[:, :half], "up": w[:, half:]}
        for p, part in parts.items():
            out.append(
                (f"blk.{layer}.ffn_{p}_exps.weight", stacked(layer, p), np.ascontiguousarray(part))
            )
    return out

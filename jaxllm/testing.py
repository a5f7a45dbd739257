"""Tiny random models for tests, benchmarks and researchers: a byte-level BPE tokenizer trained
on the spot, and random Llama-family checkpoints in Hugging Face layout, written with numpy and
safetensors (no torch, no network). They load as any Hugging Face checkpoint does.

    from jaxllm.testing import write_tiny_checkpoint, write_tiny_tokenizer

    tokenizer = write_tiny_tokenizer(tmp / "tokenizer")
    model = write_tiny_checkpoint(tmp / "tiny-llama", tokenizer)  # 2 layers, width 64
    LLM(model).generate(...)

The same arguments give the same files: the weights come from a seeded numpy generator, the
tokenizer from a deterministic BPE training run over a fixed corpus. `random_qarray` makes a
quantized weight with random codes (for kernel checks and microbenchmarks);
`write_fp8_checkpoint` quantizes a checkpoint into fine-grained FP8 blocks, as DeepSeek-V3
ships.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

__all__ = ["CHATML", "write_fp8_checkpoint", "write_tiny_checkpoint", "write_tiny_tokenizer"]

# The tiny tokenizer's chat template (ChatML, as Qwen and SmolLM2 use).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a small model that ran on a CPU.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Symbols: !?.,;:-+*/=()[]{}",
    "Héllo wörld, naïve café, 日本語, emoji 🙂.",
]


def write_tiny_tokenizer(
    path: str | os.PathLike, *, vocab_size: int = 400, chat_template: str | None = CHATML
) -> Path:
    """A byte-level BPE tokenizer saved as a Hugging Face tokenizer directory, with
    `chat_template`: the special tokens `<|endoftext|>` (id 0, also unk), `<|im_start|>` (1,
    bos) and `<|im_end|>` (2, eos), the 256 bytes, and merges learned from a small fixed
    corpus up to `vocab_size` ids (the corpus runs out of merges at 445). Any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return path


def write_tiny_checkpoint(
    path: str | os.PathLike,
    tokenizer_dir: str | os.PathLike,
    *,
    architecture: str = "LlamaForCausalLM",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    extra_config: dict | None = None,
    vocab_size: int | None = None,
) -> Path:
    """A random Llama-family checkpoint in Hugging Face layout, with the tokenizer in
    `tokenizer_dir` (e.g. `write_tiny_tokenizer`'s) copied beside it.

    `architecture` is "LlamaForCausalLM" or "Qwen2ForCausalLM" (which adds q/k/v biases). The
    vocabulary is the tokenizer's plus 3 spare ids, as real checkpoints often have, or
    `vocab_size` where that is larger (e.g. to split evenly across devices). `extra_config`
    adds to or overrides config.json. Weights are larger than a trained model's init so the
    logits are peaked: greedy decoding then has clear winners, and comparisons across batch
    shapes are not decided by ties."""
    from safetensors.numpy import save_file

    path, tokenizer_dir = Path(path), Path(tokenizer_dir)
    path.mkdir(parents=True, exist_ok=True)
    vocab = len(json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"])
    vocab += 3  # spare ids past the tokenizer's, as real checkpoints often have
    vocab = max(vocab, vocab_size or 0)  # or padded further, e.g. to split evenly
    rng = np.random.default_rng(seed)
    d, f, n, k, h = hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim

    def w(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": w(vocab, d, scale=1.0),
        "model.norm.weight": 1 + w(d, scale=0.1),
    }
    if not tie_word_embeddings:
        tensors["lm_head.weight"] = w(vocab, d, scale=0.5)
    qwen = architecture == "Qwen2ForCausalLM"
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = 1 + w(d, scale=0.1)
        tensors[p + "post_attention_layernorm.weight"] = 1 + w(d, scale=0.1)
        tensors[p + "self_attn.q_proj.weight"] = w(n * h, d)
        tensors[p + "self_attn.k_proj.weight"] = w(k * h, d)
        tensors[p + "self_attn.v_proj.weight"] = w(k * h, d)
        tensors[p + "self_attn.o_proj.weight"] = w(d, n * h)
        if qwen:
            tensors[p + "self_attn.q_proj.bias"] = w(n * h, scale=0.1)
            tensors[p + "self_attn.k_proj.bias"] = w(k * h, scale=0.1)
            tensors[p + "self_attn.v_proj.bias"] = w(k * h, scale=0.1)
        tensors[p + "mlp.gate_proj.weight"] = w(f, d)
        tensors[p + "mlp.up_proj.weight"] = w(f, d)
        tensors[p + "mlp.down_proj.weight"] = w(d, f)
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": [architecture],
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": vocab,
        "hidden_size": d,
        "intermediate_size": f,
        "num_hidden_layers": num_layers,
        "num_attention_heads": n,
        "num_key_value_heads": k,
        "head_dim": h,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        **(extra_config or {}),
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    for f_ in tokenizer_dir.iterdir():
        (path / f_.name).write_bytes(f_.read_bytes())
    return path


def write_tiny_eagle3_head(
    path: str | os.PathLike,
    target_dir: str | os.PathLike,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    draft_vocab_size: int | None = None,
    draft_ids: list[int] | None = None,
    aux_layers: list[int] | None = None,
    embeddings: bool = False,
    norm_before_residual: bool = False,
    seed: int = 0,
) -> Path:
    """A random EAGLE-3 head for the checkpoint at `target_dir`, in the layout EAGLE's and
    SpecForge's training write and vLLM loads: config.json (`LlamaForCausalLMEagle3`,
    `draft_vocab_size`, `target_hidden_size`, `eagle_config` with the aux layer ids) and
    model.safetensors with `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t` and `t2d` (with
    `draft_vocab_size` smaller than the target's: the draft vocabulary is a random subset of
    the target's ids, or `draft_ids`; `d2t` their offsets), and `embed_tokens` with
    `embeddings`. `aux_layers`: the target layers read (None: not named, vLLM's default)."""
    from safetensors.numpy import save_file

    path, target = Path(path), json.loads((Path(target_dir) / "config.json").read_text())
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocab, target_d = target["vocab_size"], target["hidden_size"]
    draft_vocab = len(draft_ids) if draft_ids else draft_vocab_size or vocab
    d, f, n, k, h = hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim

    def w(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    ids = np.sort(draft_ids or rng.choice(vocab, draft_vocab, replace=False))
    t2d = np.zeros(vocab, np.bool_)
    t2d[ids] = True
    p = "midlayer."
    tensors = {
        "fc.weight": w(d, 3 * target_d),
        "norm.weight": 1 + w(d, scale=0.1),
        "lm_head.weight": w(draft_vocab, d, scale=0.5),
        "d2t": (ids - np.arange(draft_vocab)).astype(np.int64),
        "t2d": t2d,
        p + "input_layernorm.weight": 1 + w(d, scale=0.1),
        p + "hidden_norm.weight": 1 + w(d, scale=0.1),
        p + "post_attention_layernorm.weight": 1 + w(d, scale=0.1),
        p + "self_attn.q_proj.weight": w(n * h, 2 * d),
        p + "self_attn.k_proj.weight": w(k * h, 2 * d),
        p + "self_attn.v_proj.weight": w(k * h, 2 * d),
        p + "self_attn.o_proj.weight": w(d, n * h),
        p + "mlp.gate_proj.weight": w(f, d),
        p + "mlp.up_proj.weight": w(f, d),
        p + "mlp.down_proj.weight": w(d, f),
    }
    if embeddings:
        tensors["embed_tokens.weight"] = w(vocab, d, scale=1.0)
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": target_d,
        "hidden_size": d,
        "intermediate_size": f,
        "num_hidden_layers": 1,
        "num_attention_heads": n,
        "num_key_value_heads": k,
        "head_dim": h,
        "hidden_act": "silu",
        "max_position_embeddings": target.get("max_position_embeddings", 2048),
        "rms_norm_eps": 1e-5,
        "rope_theta": target.get("rope_theta", 10000.0),
        "tie_word_embeddings": False,
        "norm_before_residual": norm_before_residual,
        "eagle_config": {"use_aux_hidden_state": True},
        "torch_dtype": "float32",
    }
    if aux_layers is not None:
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = aux_layers
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def random_qarray(rng, fmt: str, o: int, i: int, groups: int, offset: bool, scale_dtype):
    """A `jaxllm.quantization.QArray` [o, i] with random codes (numpy leaves): `groups`
    scales (and with `offset`, offsets) a row, in `scale_dtype`."""
    import ml_dtypes

    from jaxllm.quantization import QArray, pack_int4

    if fmt == "int8":
        q = rng.integers(-128, 128, (o, i)).astype(np.int8)
    elif fmt == "fp8":
        q = rng.standard_normal((o, i)).astype(ml_dtypes.float8_e4m3fn)
    else:
        q = pack_int4(rng.integers(0, 16, (o, i)).astype(np.uint8))
    scale = rng.uniform(0.01, 0.1, (o, groups)).astype(scale_dtype)
    off = rng.standard_normal((o, groups)).astype(scale_dtype) if offset else None
    return QArray(q, scale, off, fmt, (o,), np.dtype(np.float32))


FP8_MAX = 448.0  # float8 e4m3's largest value


def write_fp8_checkpoint(
    src: str | os.PathLike, dst: str | os.PathLike, block: list[int], *, ue8m0: bool = False
) -> Path:
    """The Hugging Face checkpoint at `src` (one model.safetensors) written to `dst` with every
    linear layer's weight (`*proj.weight`, `*proj_with_mqa.weight`) in float8 e4m3 and one
    float32 factor per block of `block` [rows, columns] (`weight_scale_inv`, which multiplies;
    partial blocks at the edges), as transformers' FineGrainedFP8Config and DeepSeek-V3's
    checkpoints have it: `quantization_config` `{"quant_method": "fp8", "weight_block_size":
    block}`. With `ue8m0` the factors are powers of two stored as float8_e8m0fnu (`scale_fmt:
    ue8m0`). Other files are copied."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    src, dst = Path(src), Path(dst)
    bo, bi = block
    out = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not (name.endswith(("proj.weight", "proj_with_mqa.weight")) and w.ndim == 2):
            out[name] = w
            continue
        o, i = w.shape
        rows, cols = -(-o // bo), -(-i // bi)
        padded = np.zeros((rows * bo, cols * bi), np.float32)
        padded[:o, :i] = w.astype(np.float32)
        blocks = padded.reshape(rows, bo, cols, bi)
        scale = np.abs(blocks).max(axis=(1, 3)) / np.float32(FP8_MAX)  # [rows, cols]
        scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
        if ue8m0:
            scale = np.exp2(np.ceil(np.log2(scale))).astype(np.float32)
        q = (blocks / scale[:, None, :, None]).reshape(rows * bo, cols * bi)[:o, :i]
        out[name] = q.astype(ml_dtypes.float8_e4m3fn)
        stored = scale.astype(ml_dtypes.float8_e8m0fnu) if ue8m0 else scale
        out[name.replace(".weight", ".weight_scale_inv")] = stored
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        **({"scale_fmt": "ue8m0"} if ue8m0 else {}),
    }
    (dst / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst

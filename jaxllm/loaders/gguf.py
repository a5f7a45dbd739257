"""Loading a GGUF file (llama.cpp's format).

The container is read by `gguf_file.GGUFFile` (fast: string arrays are skipped unless the
tokenizer must be built) and tensors are dequantized by the `gguf` package. The metadata
becomes a Hugging Face style config dict; each tensor is dequantized to float32,
renamed to its Hugging Face name, and (for the llama architecture) the rows of the Q and K
projections are put back in Hugging Face order: llama.cpp's converter permutes them for its
interleaved RoPE layout. The tokenizer and chat template come from the metadata through
transformers' converters; the converted tokenizer is cached beside our other caches, keyed by
the file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.loaders.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

# general.architecture -> (HF architecture, whether llama.cpp permuted Q/K rows)
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def gguf_hf_config(reader: GGUFFile) -> dict:
    """The GGUF metadata as a Hugging Face `config.json` dict."""
    arch = reader.field("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}"
        )
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names or reader.field(f"{arch}.rope.scaling.type"):
        raise ValueError(
            "GGUF rope scaling (rope_freqs / rope.scaling.*) is not supported yet; load the "
            "Hugging Face checkpoint of this model instead"
        )
    heads = reader.field(f"{arch}.attention.head_count")
    hidden = reader.field(f"{arch}.embedding_length")
    tokens = reader.field("tokenizer.ggml.tokens") or []
    eos = reader.field("tokenizer.ggml.eos_token_id")
    return {
        "architectures": [_ARCHITECTURES[arch][0]],
        "vocab_size": reader.field(f"{arch}.vocab_size") or len(tokens),
        "hidden_size": hidden,
        "intermediate_size": reader.field(f"{arch}.feed_forward_length"),
        "num_hidden_layers": reader.field(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": reader.field(f"{arch}.attention.head_count_kv", heads),
        "head_dim": reader.field(f"{arch}.attention.key_length", hidden // heads),
        "max_position_embeddings": reader.field(f"{arch}.context_length", 2048),
        "rms_norm_eps": reader.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": reader.field(f"{arch}.rope.freq_base", 10000.0),
        "sliding_window": reader.field(f"{arch}.attention.sliding_window"),
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": reader.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
    }


def load_gguf_config(path: Path) -> ModelConfig:
    return ModelConfig.from_hf_config(gguf_hf_config(GGUFFile(path)))


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's `permute`: rows of each head go from interleaved pairs back to halves."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def iter_gguf(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 tensor in HF layout) pairs, dequantized one at a time."""
    import gguf

    reader = GGUFFile(path)
    config = gguf_hf_config(reader)
    arch = reader.field("general.architecture")
    permuted = _ARCHITECTURES[arch][1]
    for t in reader.tensors:
        if t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        else:
            parts = t.name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
                raise ValueError(f"unexpected tensor {t.name!r} in GGUF file {path}")
            name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
        try:
            qtype = gguf.GGMLQuantizationType(t.ggml_type)
        except ValueError:
            raise ValueError(
                f"tensor {t.name!r} in {path} has unknown GGML type {t.ggml_type}"
            ) from None
        try:
            w = gguf.quants.dequantize(reader.raw(t), qtype)
        except NotImplementedError as e:
            raise ValueError(
                f"tensor {t.name!r} in {path} has type {qtype.name}, which the gguf package "
                f"cannot dequantize"
            ) from e
        w = np.asarray(w, dtype=np.float32).reshape(t.shape)
        if permuted and name.endswith("q_proj.weight"):
            w = _unpermute(w, config["num_attention_heads"])
        elif permuted and name.endswith("k_proj.weight"):
            w = _unpermute(w, config["num_key_value_heads"])
        yield name, w


def _tokenizer_from_metadata(path: Path):
    """Builds the tokenizer from the GGUF metadata without torch.

    transformers' own `AutoTokenizer.from_pretrained(gguf_file=...)` imports torch (its GGUF
    reader does), which is not a runtime dependency of ours. Its tokenizer converters do not,
    so we read the metadata with `GGUFFile` and hand it to them. Where this
    transformers version lacks those functions we fall back to the public path, which then
    needs torch; the tests check that both paths encode text the same way."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping as m

        mapping, convert = m.GGUF_TOKENIZER_MAPPING, m.convert_gguf_tokenizer
        special = m._SPECIAL_TOKENS
    except (ImportError, AttributeError):
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    metadata = {
        key: value
        for key, value in GGUFFile(path, string_arrays=True).metadata.items()
        if key.startswith("tokenizer.") or key == "general.architecture"
    }
    groups = {
        group: {
            name: metadata[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in metadata
        }
        for group, renames in mapping.items()
    }
    tokenizer_dict, tokenizer_config = groups["tokenizer"], groups["tokenizer_config"]
    if "tokens" not in tokenizer_dict:
        raise ValueError(f"GGUF file {path} carries no tokenizer (tokenizer.ggml.tokens)")
    if tokenizer_dict.get("tokenizer_type") == "llama":
        tokenizer_config.setdefault("add_bos_token", True)  # llama.cpp's default for SPM
    for name, key in special.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = (
            tokenizer_dict["tokens"][token_id] if token_id is not None else None
        )
    backend, extra = convert(metadata["general.architecture"], tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def load_gguf_tokenizer(path: Path, cache_dir: Path):
    """The tokenizer (with chat template) built from the GGUF metadata, cached after the first
    conversion (which takes ~10 s for a 49k vocabulary)."""
    from transformers import AutoTokenizer

    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    cached = cache_dir / "tokenizers" / key[:16]
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    logger.info("building the tokenizer from %s (cached afterwards)", path.name)
    tokenizer = _tokenizer_from_metadata(path)
    # Write to a private directory, then rename: a concurrent loader sees all or nothing.
    cached.parent.mkdir(parents=True, exist_ok=True)
    if cached.exists():  # an incomplete leftover (no tokenizer.json): replace it
        shutil.rmtree(cached, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent))
    try:
        tokenizer.save_pretrained(tmp)
        tmp.replace(cached)
    except OSError:  # another process won the race
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer

"""Loading a GGUF file (llama.cpp's format).

The container is read by `gguf_file.GGUFFile` (fast: string arrays are skipped unless the
tokenizer must be built) and tensors are dequantized by the `gguf` package. The metadata
becomes a Hugging Face style config dict (`gguf_hf_config`); each tensor is dequantized to
float32 and renamed to its Hugging Face name (`iter_gguf`), undoing what llama.cpp's converter
(`convert_hf_to_gguf.py`) did to it on the way in:

- llama / mistral: the rows of the Q and K projections are permuted for llama.cpp's
  interleaved RoPE; we put them back in Hugging Face order.
- gemma3: every norm weight is stored as 1 + w (llama.cpp's RMSNorm multiplies by the weight,
  Gemma's by 1 + weight); we subtract the 1 again.
- Llama 3.1: the llama3 RoPE scaling is stored as a `rope_freqs` tensor of per-frequency
  divisors instead of metadata; it becomes the config's `rope_freq_factors`, not a weight.

With `keep_quantized` (the default of `load_model`: see jaxllm.quantization), tensors of
the block types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K are not dequantized: their
integers are unpacked into a `QArray` (int4 for the 4-bit types, int8 for the 5-, 6- and 8-bit
ones) with one scale (and offset) per block or sub-block, computed from the block's
half-precision factors exactly as the `gguf` package does (kept in float16 where exact, else
float32: `quantization.compact_factors`), so the weights are bit for bit
those of its dequantization (tests/test_quantization.py; only a Q4_0 zero can differ in
sign). Other types are dequantized.

What llama.cpp hard-codes instead of storing (Gemma 3's local RoPE base and its 5:1 pattern
of sliding-window and global layers) is filled in here the same way. The tokenizer and chat
template come from the metadata through transformers' converters; the converted tokenizer is
cached beside our other caches, keyed by the file's path, size and modification time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jaxllm import quantization
from jaxllm.config import ModelConfig
from jaxllm.loaders.gguf_file import GGUFFile, TensorInfo

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<GGUF suffix> -> model.layers.N.<HF suffix>
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
_QK_NORM_NAMES = {
    **_LAYER_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma's four norms per layer: llama.cpp's ffn_norm is the norm *before* the MLP, which
# Gemma calls pre_feedforward_layernorm (its post_attention_layernorm is after attention).
_GEMMA3_NAMES = {
    **_QK_NORM_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


@dataclasses.dataclass(frozen=True)
class _Arch:
    """How llama.cpp's converter wrote one `general.architecture`."""

    hf_architecture: str
    model_type: str
    layer_names: dict[str, str]
    permuted_qk: bool = False
    """Q/K rows were permuted for llama.cpp's interleaved RoPE (its `LlamaModel.permute`)."""
    norm_shift: float = 0.0
    """Norm weights were stored as w + norm_shift (Gemma: 1)."""


_ARCHITECTURES = {
    "llama": _Arch("LlamaForCausalLM", "llama", _LAYER_NAMES, permuted_qk=True),
    "mistral": _Arch("MistralForCausalLM", "mistral", _LAYER_NAMES, permuted_qk=True),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", _LAYER_NAMES),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", _QK_NORM_NAMES),
    "gemma3": _Arch("Gemma3ForCausalLM", "gemma3_text", _GEMMA3_NAMES, norm_shift=1.0),
}

# Gemma's chat template (google/gemma-3-*-it): <bos> first, the roles user and model, and a
# system prompt folded into the first user turn (text parts only: image parts are dropped).
_GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- else -%}"
    "{%- for item in message['content'] if item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\n' }}"
    "{%- endif -%}"
)

# general.architecture -> (the chat template used when the file has no
# tokenizer.chat_template, the token that ends a turn in it). The end-of-turn token also ends
# generation whether or not the file has a template, as llama.cpp's end-of-generation set does.
_CHAT_FORMATS = {
    "gemma3": (_GEMMA_CHAT_TEMPLATE, "<end_of_turn>"),
}


def gguf_hf_config(reader: GGUFFile) -> dict:
    """The GGUF metadata as a Hugging Face `config.json` dict (plus `rope_freq_factors` for
    llama.cpp's `rope_freqs` tensor)."""
    arch = reader.field("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    if any(".ffn_gate_inp." in name for name in tensors):
        raise ValueError(
            f"{reader.path} is a mixture-of-experts GGUF file (ffn_gate_inp), which we cannot "
            "load yet; load the model's Hugging Face checkpoint instead"
        )
    heads = reader.field(f"{arch}.attention.head_count")
    hidden = reader.field(f"{arch}.embedding_length")
    head_dim = reader.field(f"{arch}.attention.key_length", hidden // heads)
    config = {
        "architectures": [_ARCHITECTURES[arch].hf_architecture],
        "model_type": _ARCHITECTURES[arch].model_type,
        "vocab_size": reader.field(f"{arch}.vocab_size")
        or len(reader.field("tokenizer.ggml.tokens") or []),
        "hidden_size": hidden,
        "intermediate_size": reader.field(f"{arch}.feed_forward_length"),
        "num_hidden_layers": reader.field(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": reader.field(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": reader.field(f"{arch}.context_length", 2048),
        "rms_norm_eps": reader.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": reader.field(f"{arch}.rope.freq_base", 10000.0),
        "sliding_window": reader.field(f"{arch}.attention.sliding_window") or None,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": reader.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_token_ids(reader, arch),
        "pad_token_id": reader.field("tokenizer.ggml.padding_token_id"),
    }
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if (cap := reader.field(f"{arch}.{key}")) is not None:
            config[key] = cap
    if rope_scaling := _rope_scaling(reader, arch):
        config["rope_scaling"] = rope_scaling
    if "rope_freqs.weight" in tensors:
        factors = _dequantize(reader, tensors["rope_freqs.weight"])
        if factors.shape != (head_dim // 2,):
            raise ValueError(
                f"rope_freqs.weight in {reader.path} has shape {factors.shape}; expected "
                f"({head_dim // 2},), one factor per RoPE frequency"
            )
        config["rope_freq_factors"] = factors.tolist()
    if arch == "gemma3":
        config.update(_gemma3_config(reader, config))
    return config


def _gemma3_config(reader: GGUFFile, config: dict) -> dict:
    """What Gemma 3 needs beyond the common keys; llama.cpp hard-codes most of it."""
    num_layers = config["num_hidden_layers"]
    # Every 6th layer is global, the others slide (llama.cpp: `set_swa_pattern(6)`); a file
    # may state the pattern as a period or as one flag per layer (true = sliding). Without a
    # window (llama.cpp reads none as 0) every layer is global.
    pattern = reader.field("gemma3.attention.sliding_window_pattern", 6)
    if not config["sliding_window"]:
        sliding = [False] * num_layers
    elif isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    # llama.cpp scales queries by 1/sqrt(hidden / heads) in the 27B (its only 62-layer size)
    # and by 1/sqrt(head_dim) in every other size.
    if num_layers == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        scalar = config["head_dim"]
    return {
        "layer_types": [
            "sliding_attention" if s else "full_attention" for s in sliding[:num_layers]
        ],
        "rope_local_base_freq": reader.field("gemma3.rope.freq_base_swa", 10000.0),
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _rope_scaling(reader: GGUFFile, arch: str) -> dict | None:
    """`{arch}.rope.scaling.*` as HF's `rope_scaling`: linear only (Gemma 3's global layers in
    the 4B and larger); None when absent or a factor of 1."""
    kind = reader.field(f"{arch}.rope.scaling.type")
    factor = reader.field(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind != "linear":
        raise ValueError(
            f"GGUF rope scaling {kind!r} ({arch}.rope.scaling.type) is not supported (only "
            "linear, and llama.cpp's rope_freqs); load the Hugging Face checkpoint instead"
        )
    return {"rope_type": "linear", "factor": float(factor)}


def _eos_token_ids(reader: GGUFFile, arch: str) -> int | list[int] | None:
    """The tokens that end generation: the file's EOS, end-of-turn and end-of-message ids, and
    the end-of-turn token of the architecture's chat format."""
    ids = [
        reader.field(f"tokenizer.ggml.{key}")
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
    ]
    if arch in _CHAT_FORMATS:
        ids.append(reader.string_index("tokenizer.ggml.tokens", _CHAT_FORMATS[arch][1]))
    ids = list(dict.fromkeys(i for i in ids if i is not None))
    return ids[0] if len(ids) == 1 else ids or None


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


def _dequantize(reader: GGUFFile, t: TensorInfo) -> np.ndarray:
    """One tensor as float32 in its row-major shape; a clear error for a type we cannot use."""
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(t.ggml_type)
    except ValueError:
        raise ValueError(
            f"tensor {t.name!r} in {reader.path} has unknown GGML type {t.ggml_type}"
        ) from None
    try:
        w = gguf.quants.dequantize(reader.raw(t), qtype)
    except NotImplementedError as e:
        raise ValueError(
            f"tensor {t.name!r} in {reader.path} has type {qtype.name}, which the gguf package "
            f"cannot dequantize"
        ) from e
    return np.asarray(w, dtype=np.float32).reshape(t.shape)


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian half-precision factors (2 bytes each on the last axis) as float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return b & np.uint8(15), b >> np.uint8(4)


def _quantized(reader: GGUFFile, t: TensorInfo) -> quantization.QArray | None:
    """A 2-D tensor of a block type we keep as a QArray (rows: [O, I]); None for others."""
    import gguf

    kind = gguf.GGMLQuantizationType(t.ggml_type)
    T = gguf.GGMLQuantizationType
    if len(t.shape) != 2 or kind not in (
        T.Q8_0,
        T.Q4_0,
        T.Q4_1,
        T.Q5_0,
        T.Q5_1,
        T.Q4_K,
        T.Q5_K,
        T.Q6_K,
    ):
        return None
    raw = reader.raw(t)
    rows, cols = t.shape
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    b = raw.reshape(rows, cols // block_size, type_size)
    offset = None
    if kind == T.Q8_0:
        scale, q, fmt = _f16(b[..., :2]), b[..., 2:].view(np.int8).reshape(rows, cols), "int8"
    elif kind in (T.Q4_0, T.Q4_1):
        scale = _f16(b[..., :2])
        start = 2 if kind == T.Q4_0 else 4
        offset = -8 * scale if kind == T.Q4_0 else _f16(b[..., 2:4])
        q, fmt = np.ascontiguousarray(b[..., start:]).reshape(rows, cols // 2), "int4"
    elif kind in (T.Q5_0, T.Q5_1):
        scale = _f16(b[..., :2])
        start = 2 if kind == T.Q5_0 else 4
        high = np.ascontiguousarray(b[..., start : start + 4]).view(np.uint32)  # bit i: element i
        high = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = np.concatenate(_nibbles(b[..., start + 4 :]), axis=-1) | (high << 4)
        q = q.astype(np.int8)
        if kind == T.Q5_0:
            q = q - np.int8(16)
        else:
            offset = _f16(b[..., 2:4])
        q, fmt = q.reshape(rows, cols), "int8"
    elif kind in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        sc, mn = gguf.quants.Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
        sc, mn = sc.reshape(rows, -1, 8), mn.reshape(rows, -1, 8)
        scale = (d * sc.astype(np.float32)).reshape(rows, -1)
        offset = -(dmin * mn.astype(np.float32)).reshape(rows, -1)
        qs = b[..., 16:] if kind == T.Q4_K else b[..., 48:]
        # 32 bytes per pair of sub-blocks: low nibbles the first 32 elements, high the next.
        lo, hi = _nibbles(qs.reshape(rows, -1, 4, 32))
        q = np.stack([lo, hi], axis=-2).reshape(rows, cols)
        if kind == T.Q4_K:
            q, fmt = quantization.pack_int4(q), "int4"
        else:
            qh = b[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
            q = q | ((qh & 1).reshape(rows, cols) << 4)
            q, fmt = q.astype(np.int8), "int8"
    else:  # Q6_K: ql 128 bytes, qh 64, scales 16 (int8, one per 16 elements), d
        ql, qh = b[..., :128], b[..., 128:192]
        lo, hi = _nibbles(ql.reshape(rows, -1, 2, 1, 64))
        low = np.concatenate([lo, hi], axis=-2).reshape(rows, -1, 2, 4, 32)
        high = (qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).reshape(rows, cols)
        d = _f16(b[..., 208:210])[..., None]
        scale = (d * b[..., 192:208].view(np.int8).astype(np.float32)).reshape(rows, -1)
        fmt = "int8"
    scale, offset = quantization.compact_factors(scale, offset)
    return quantization.QArray(
        q,
        scale.reshape(rows, -1),
        None if offset is None else offset.reshape(rows, -1),
        fmt,
        (rows,),
        np.dtype(np.float32),
    )


def iter_gguf(path: Path, *, keep_quantized: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, tensor in HF layout) pairs, one at a time: float32 arrays, or with
    `keep_quantized` a QArray for each tensor of a block type we keep (see above)."""
    reader = GGUFFile(path)
    config = gguf_hf_config(reader)
    arch = _ARCHITECTURES[reader.field("general.architecture")]
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # in the config, as rope_freq_factors
            continue
        if t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        else:
            parts = t.name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in arch.layer_names:
                raise ValueError(f"unexpected tensor {t.name!r} in GGUF file {path}")
            name = f"model.layers.{parts[1]}.{arch.layer_names[parts[2]]}"
        w = _quantized(reader, t) if keep_quantized else None
        if w is None:
            w = _dequantize(reader, t)
            if arch.norm_shift and t.name.endswith("norm.weight"):
                w = w - arch.norm_shift
        if arch.permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            if isinstance(w, quantization.QArray):  # the same rows, of q and its factors
                w = w.map_rows(lambda a, heads=heads: _unpermute(a, heads))
            else:
                w = _unpermute(w, heads)
        yield name, w


def _tokenizer_from_metadata(path: Path):
    """Builds the tokenizer from the GGUF metadata without torch.

    transformers' own `AutoTokenizer.from_pretrained(gguf_file=...)` imports torch (its GGUF
    reader does), which is not a runtime dependency of ours. Its tokenizer converters do not,
    so we read the metadata with `GGUFFile` and hand it to them. Where this
    transformers version lacks those functions we fall back to the public path, which then
    needs torch; the tests check that both paths encode text the same way. A file without a
    chat template gets its architecture's from `_CHAT_FORMATS`."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping as m

        mapping, convert = m.GGUF_TOKENIZER_MAPPING, m.convert_gguf_tokenizer
        special = m._SPECIAL_TOKENS
    except (ImportError, AttributeError):
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        arch = GGUFFile(path).field("general.architecture")
        if tokenizer.chat_template is None and arch in _CHAT_FORMATS:
            tokenizer.chat_template = _CHAT_FORMATS[arch][0]
        return tokenizer
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
    arch = metadata["general.architecture"]
    if arch in _CHAT_FORMATS:
        tokenizer_config.setdefault("chat_template", _CHAT_FORMATS[arch][0])
    backend, extra = convert(arch, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


# Part of the tokenizer cache key: bump it when `_tokenizer_from_metadata` builds differently.
_TOKENIZER_CACHE_VERSION = 2


def load_gguf_tokenizer(path: Path, cache_dir: Path):
    """The tokenizer (with chat template) built from the GGUF metadata, cached after the first
    conversion (which takes ~10 s for a 49k vocabulary, ~15 s for Gemma's 262k)."""
    from transformers import AutoTokenizer

    stat = path.stat()
    key = hashlib.sha256(
        f"{_TOKENIZER_CACHE_VERSION}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    ).hexdigest()
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

"""Loading a GGUF file (llama.cpp's format).

The container is read by `gguf_file.GGUFFile` (fast: string arrays are skipped unless the
tokenizer must be built) and tensors are dequantized by the `gguf` package. The metadata
becomes a Hugging Face style config dict (`gguf_hf_config`); each tensor is dequantized to
float32 and renamed to its Hugging Face name (`iter_gguf`), undoing what llama.cpp's converter
(`convert_hf_to_gguf.py`) did to it on the way in, as each family's `GGUFFormat` says
(`jaxllm/families/`):

- llama / mistral: the rows of the Q and K projections are permuted for llama.cpp's
  interleaved RoPE; we put them back in Hugging Face order.
- gemma3: every norm weight is stored as 1 + w (llama.cpp's RMSNorm multiplies by the weight,
  Gemma's by 1 + weight); we subtract the 1 again.
- Llama 3.1: the llama3 RoPE scaling is stored as a `rope_freqs` tensor of per-frequency
  divisors instead of metadata; it becomes the config's `rope_freq_factors`, not a weight.
- Mixtures of experts (Mixtral, Qwen3-MoE, gpt-oss, Llama 4): each projection of every
  expert is one stacked `ffn_*_exps` tensor [E, out, in]; it comes input-major, as the
  decoder holds experts, and gpt-oss's MXFP4 ones as `MXFP4Experts` where they stay 4-bit
  (`_stacked_experts`). Layers without a router are dense.
- Gemma 4: norms stored as they are; layer kinds, head widths, kv heads and MLP widths given
  per layer; the full layers' proportional RoPE written as a `rope_freqs` tensor (ones, then
  1e30 for the pairs that do not turn) that its family reads back as a partial factor.

With `keep_quantized` (the default of `load_model`: see jaxllm.quantization), tensors of
the block types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K are not dequantized: their
integers are unpacked into a `QArray` (int4 for the 4-bit types, int8 for the 5-, 6- and 8-bit
ones) with one scale (and offset) per block or sub-block, computed from the block's
half-precision factors exactly as the `gguf` package does (kept in float16 where exact, else
float32: `quantization.compact_factors`), so the weights are bit for bit
those of its dequantization (tests/test_quantization.py; only a Q4_0 zero can differ in
sign). Other types, and stacked experts of any type but MXFP4, are dequantized.

What llama.cpp hard-codes instead of storing (Gemma 3's local RoPE base and its 5:1 pattern
of sliding-window and global layers) its family module fills in the same way
(`GGUFFormat.read_config`). The tokenizer and chat template come from the metadata through transformers' converters; the converted tokenizer is
cached beside our other caches, keyed by the file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jaxllm import quantization
from jaxllm.config import ModelConfig
from jaxllm.families import GGUF_FAMILIES, GGUF_GLOBAL_NAMES
from jaxllm.loaders.gguf_file import GGUFFile, TensorInfo

logger = logging.getLogger(__name__)


def gguf_hf_config(reader: GGUFFile) -> dict:
    """The GGUF metadata as a Hugging Face `config.json` dict (plus `rope_freq_factors` for
    llama.cpp's `rope_freqs` tensor)."""
    arch = reader.field("general.architecture")
    if arch not in GGUF_FAMILIES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_FAMILIES)}"
        )
    family = GGUF_FAMILIES[arch]
    tensors = {t.name: t for t in reader.tensors}
    experts = reader.field(f"{arch}.expert_count") or 0
    routed = any(name.endswith(".ffn_gate_inp.weight") for name in tensors)
    if (experts or routed) and "ffn_gate_inp.weight" not in family.gguf.layer_names:
        raise ValueError(
            f"{reader.path} is a mixture-of-experts GGUF file of architecture {arch!r}, which "
            "we cannot load from GGUF; load the model's Hugging Face checkpoint instead"
        )
    heads = reader.field(f"{arch}.attention.head_count")
    hidden = reader.field(f"{arch}.embedding_length")
    head_dim = reader.field(f"{arch}.attention.key_length", hidden // heads)
    config = {
        "architectures": [family.architecture],
        "model_type": family.gguf.model_type,
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
    if experts:
        num_layers = config["num_hidden_layers"]
        config |= {
            "num_local_experts": experts,
            "num_experts_per_tok": _required(reader, f"{arch}.expert_used_count"),
            "moe_intermediate_size": reader.field(
                f"{arch}.expert_feed_forward_length", config["intermediate_size"]
            ),
            # Layers without a router are dense (llama.cpp's Llama 4 interleaves them).
            "mlp_only_layers": [
                i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors
            ],
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
    if family.gguf.read_config is not None:
        config.update(family.gguf.read_config(reader, config))
    return config


def _required(reader: GGUFFile, key: str):
    value = reader.field(key)
    if not value:
        raise ValueError(f"{reader.path} lacks {key} (or gives 0), which its tensors need")
    return value


def _rope_scaling(reader: GGUFFile, arch: str) -> dict | None:
    """`{arch}.rope.scaling.*` as HF's `rope_scaling`: linear (Gemma 3's global layers in the
    4B and larger) or YaRN (gpt-oss; its beta and attention factors where the file has them);
    None when absent or a factor of 1."""
    key = f"{arch}.rope.scaling"
    kind = reader.field(f"{key}.type")
    factor = reader.field(f"{key}.factor")
    if kind in (None, "none") or (kind in ("linear", "yarn") and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind != "yarn":
        raise ValueError(
            f"GGUF rope scaling {kind!r} ({key}.type) is not supported (only linear, yarn and "
            "llama.cpp's rope_freqs); load the Hugging Face checkpoint instead"
        )
    original = reader.field(f"{key}.original_context_length")
    if original is None:
        raise ValueError(f"YaRN scaling without {key}.original_context_length")
    scaling = {"rope_type": "yarn", "factor": float(factor)}
    scaling["original_max_position_embeddings"] = int(original)
    for name, hf_name in (
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
        ("yarn_attn_factor", "attention_factor"),
    ):
        if (value := reader.field(f"{key}.{name}")) is not None:
            scaling[hf_name] = float(value)
    return scaling


def _eos_token_ids(reader: GGUFFile, arch: str) -> int | list[int] | None:
    """The tokens that end generation: the file's EOS, end-of-turn and end-of-message ids, and
    the end-of-turn token of the architecture's chat format."""
    ids = [
        reader.field(f"tokenizer.ggml.{key}")
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
    ]
    for token in GGUF_FAMILIES[arch].gguf.end_of_turn:
        ids.append(reader.string_index("tokenizer.ggml.tokens", token))
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


def _stacked_experts(
    reader: GGUFFile, t: TensorInfo, keep_mxfp4: bool
) -> np.ndarray | quantization.MXFP4Experts:
    """A stacked expert projection `ffn_*_exps` ([E, out, in] in the file) input-major, as
    the decoder holds it: float32 [E, in, out], or, for MXFP4 with `keep_mxfp4`, the same
    4-bit codes and scales as an `MXFP4Experts` (which stands for [E, in, out]).

    ggml's MXFP4 block is 17 bytes: the E8M0 scale, then 16 bytes whose low nibbles are the
    block's first 16 values and high nibbles its last 16 (`MXFP4Experts` pairs neighbours:
    values 2k and 2k + 1 in byte k, as gpt-oss's checkpoints do)."""
    import gguf

    if len(t.shape) != 3:
        raise ValueError(
            f"tensor {t.name!r} in {reader.path} has shape {list(t.shape)}; stacked experts "
            "are [experts, out, in]"
        )
    if keep_mxfp4 and t.ggml_type == gguf.GGMLQuantizationType.MXFP4:
        experts, rows, cols = t.shape
        b = reader.raw(t).reshape(experts, rows, cols // quantization.MXFP4_BLOCK, 17)
        even, odd = b[..., 1::2], b[..., 2::2]  # qs[2k], qs[2k + 1], k < 8
        codes = np.empty((*b.shape[:-1], 16), np.uint8)
        codes[..., :8] = (even & 15) | ((odd & 15) << 4)  # values 2k, 2k + 1 (low nibbles)
        codes[..., 8:] = (even >> 4) | (odd & 0xF0)  # values 16 + 2k, 17 + 2k (high ones)
        return quantization.MXFP4Experts(
            codes.reshape(experts, rows, cols // 2),
            np.ascontiguousarray(b[..., 0]),
            np.dtype(np.float32),
        )
    return np.ascontiguousarray(_dequantize(reader, t).transpose(0, 2, 1))


def has_mxfp4(path: Path) -> bool:
    """Whether the file holds MXFP4 stacked experts the loader keeps 4-bit (gpt-oss's, as
    llama.cpp ships them; `_stacked_experts`)."""
    import gguf

    reader = GGUFFile(path)
    family = GGUF_FAMILIES.get(reader.field("general.architecture"))
    names = family.gguf.layer_names if family is not None else {}
    return any(
        t.ggml_type == gguf.GGMLQuantizationType.MXFP4
        and names.get(t.name.split(".", 2)[-1], "").endswith("_proj_stacked")
        for t in reader.tensors
    )


def iter_gguf(
    path: Path, *, keep_quantized: bool = False, keep_mxfp4: bool = False
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, tensor in HF layout) pairs, one at a time: float32 arrays, or with
    `keep_quantized` a QArray for each tensor of a block type we keep (see above). Stacked
    experts come input-major (`_stacked_experts`), MXFP4 ones kept 4-bit with
    `keep_mxfp4` (`loaders.mxfp4_kept`)."""
    reader = GGUFFile(path)
    config = gguf_hf_config(reader)
    arch = GGUF_FAMILIES[reader.field("general.architecture")].gguf
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # in the config, as rope_freq_factors
            continue
        if t.name in GGUF_GLOBAL_NAMES:
            name = GGUF_GLOBAL_NAMES[t.name]
        else:
            parts = t.name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in arch.layer_names:
                fused = (
                    " (fused gate/up experts are read for gemma4 only)"
                    if "gate_up_exps" in t.name
                    else ""
                )
                raise ValueError(f"unexpected tensor {t.name!r} in GGUF file {path}{fused}")
            name = f"model.layers.{parts[1]}.{arch.layer_names[parts[2]]}"
        if name.endswith("_proj_stacked"):
            yield name, _stacked_experts(reader, t, keep_mxfp4)
            continue
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
    chat template gets its family's (`GGUFFormat.chat_template`)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping as m

        mapping, convert = m.GGUF_TOKENIZER_MAPPING, m.convert_gguf_tokenizer
        special = m._SPECIAL_TOKENS
    except (ImportError, AttributeError):
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        family = GGUF_FAMILIES.get(GGUFFile(path).field("general.architecture"))
        if tokenizer.chat_template is None and family is not None:
            tokenizer.chat_template = family.gguf.chat_template
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
    family = GGUF_FAMILIES.get(arch)
    if family is not None and family.gguf.chat_template is not None:
        tokenizer_config.setdefault("chat_template", family.gguf.chat_template)
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

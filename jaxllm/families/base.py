"""What a model family is: the few facts that set one architecture apart from the Llama
decoder every family runs on (`jaxllm.models`), in one record per Hugging Face architecture.

A family module (`llama.py`, `qwen.py`, `gemma.py`, `mixtral.py`, `llava.py`) registers its
records: the `ModelConfig` features it turns on, how its Hugging Face config differs (older
configs that name no layer types, keys read differently), its tensor names where they differ
from Llama's, and how llama.cpp's converter wrote it to GGUF. Nothing here imports the rest of
the library: `hf_config.py` beside it reads a config.json through these records (for
`ModelConfig.from_hf_config`), and the loaders read them for tensor names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
CHUNKED_ATTENTION = "chunked_attention"  # Llama 4: keys of the query's own chunk only
LINEAR_ATTENTION = "linear_attention"  # a Gated DeltaNet layer (Qwen3-Next, Qwen3.5)


def every_layer_slides(config: dict, num_layers: int) -> list[bool]:
    return [True] * num_layers


# Image-text checkpoints: the text decoder's tensors under a prefix, which comes off, and the
# vision side's, which the decoder skips (`jaxllm.loaders.vision` reads them).
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "visual.",  # Qwen2.5-VL's
    "model.visual.",
    "vision_model.",  # Llama 4's
    "model.vision_model.",
    "model.embed_vision.",  # Gemma 4's, and its audio side
    "model.audio_tower.",
    "model.embed_audio.",
)


def image_text_tensor_name(name: str) -> str | None:
    """A tensor's name as the text decoder knows it, in an image-text checkpoint or a plain
    one; None for the vision side."""
    if name.startswith(_VISION_PREFIXES):
        return None
    if name.startswith(_TEXT_PREFIXES):
        return "model." + name.split(".", 2)[2]
    if name == "language_model.lm_head.weight":
        return "lm_head.weight"
    return name


def llama_tensor_name(name: str) -> str:
    return name


@dataclasses.dataclass(frozen=True)
class GGUFFormat:
    """How llama.cpp's converter (`convert_hf_to_gguf.py`) wrote a family: its
    `general.architecture`, and what it did to the tensors on the way in."""

    name: str
    """`general.architecture`, e.g. "llama"."""
    model_type: str
    """Hugging Face's `model_type` of the family."""
    layer_names: Mapping[str, str]
    """blk.N.<GGUF suffix> -> model.layers.N.<HF suffix>."""
    permuted_qk: bool = False
    """Q/K rows were permuted for llama.cpp's interleaved RoPE (its `LlamaModel.permute`)."""
    norm_shift: float = 0.0
    """Norm weights were stored as w + norm_shift (Gemma: 1)."""
    chat_template: str | None = None
    """The chat template for a file that carries none."""
    end_of_turn: tuple[str, ...] = ()
    """The tokens that end a turn in that template; they also end generation whether or not
    the file has a template, as llama.cpp's end-of-generation set does."""
    read_config: Callable[[Any, dict], dict] | None = None
    """(GGUF reader, the common config keys) -> the family's further HF config keys, for
    what llama.cpp hard-codes instead of storing."""


@dataclasses.dataclass(frozen=True)
class Family:
    architecture: str
    """The Hugging Face `architectures` entry, e.g. "LlamaForCausalLM"."""
    features: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """`ModelConfig` fields beyond the Llama decoder's defaults; values read from the HF
    config win (`rope_theta` and `rope_local_theta` here are defaults for configs that
    omit them)."""
    sliding_layers: Callable[[dict, int], list[bool]] = every_layer_slides
    """Which layers slide, for configs with a `sliding_window` but no `layer_types` (as
    transformers derives them for the family)."""
    read_config: Callable[[dict], dict] | None = None
    """HF config -> `ModelConfig` fields the family reads its own way; they win over all."""
    tensor_name: Callable[[str], str | None] = llama_tensor_name
    """A checkpoint tensor's name -> the Llama name the loader knows (None: skip it)."""
    layers_past_the_last_skipped: bool = False
    """The checkpoint's layers numbered from `num_hidden_layers` on are not the decoder's
    (DeepSeek-V3's multi-token-prediction modules): skipped rather than refused."""
    text_of: str | None = None
    """An image-text architecture served as its text decoder (that architecture): its config
    is `text_config`, its vision tower skipped."""
    gguf: GGUFFormat | None = None


FAMILIES: dict[str, Family] = {}
GGUF_FAMILIES: dict[str, Family] = {}  # by `general.architecture`


def register(*families: Family) -> None:
    for family in families:
        FAMILIES[family.architecture] = family
        if family.gguf is not None:
            GGUF_FAMILIES[family.gguf.name] = family


# The GGUF names most families share (llama.cpp's `gguf-py/gguf/constants.py`).
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    # Per-layer inputs (Gemma 4's small models)
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
GGUF_LAYER_NAMES = {
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
GGUF_QK_NORM_NAMES = {
    **GGUF_LAYER_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# A mixture of experts: the router, and each projection of every expert stacked in one tensor
# (`ffn_*_exps`, [E, out, in] in row-major order), which the loader yields input-major under
# the `*_stacked` names `loaders.weights` places (llama.cpp's converters stack HF's
# per-expert tensors, or split fused gate_up ones, into these).
GGUF_EXPERT_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    **{
        f"ffn_{p}_exps.{kind}": f"mlp.experts.{p}_proj_stacked{suffix}"
        for p in ("gate", "up", "down")
        for kind, suffix in (("weight", ""), ("bias", "_bias"))
    },
}

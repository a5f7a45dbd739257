"""Model families, one module each, registered by their Hugging Face architecture names
(`base.Family`: features, config quirks, tensor names, GGUF format), and the parsing of a
Hugging Face config.json through them (`hf_config`). To add a family the shared decoder
already covers, write its module and import it here."""

from __future__ import annotations

from jaxllm.families import (  # noqa: F401
    deepseek,
    gemma,
    gemma4,
    gpt_oss,
    llama,
    llama4,
    llava,
    mixtral,
    qwen,
)
from jaxllm.families.base import (
    CHUNKED_ATTENTION,
    FAMILIES,
    FULL_ATTENTION,
    GGUF_FAMILIES,
    GGUF_GLOBAL_NAMES,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    Family,
    GGUFFormat,
    image_text_tensor_name,
)


def text_family_of(family: Family, config: dict) -> Family:
    """The text decoder's family of an image-text architecture: the family whose model type
    `text_config` names (LLaVA's decoder is a Llama, a Mistral, a Qwen2...), else the
    architecture's own `text_of`."""
    model_type = (config.get("text_config") or {}).get("model_type")
    for f in FAMILIES.values():
        if f.text_of is None and f.gguf is not None and f.gguf.model_type == model_type:
            return f
    return family_of(family.text_of)


def family_of(architecture: str) -> Family:
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(FAMILIES)}"
        ) from None


__all__ = [
    "CHUNKED_ATTENTION",
    "FAMILIES",
    "FULL_ATTENTION",
    "GGUF_FAMILIES",
    "GGUF_GLOBAL_NAMES",
    "LINEAR_ATTENTION",
    "SLIDING_ATTENTION",
    "Family",
    "GGUFFormat",
    "family_of",
    "image_text_tensor_name",
    "text_family_of",
]

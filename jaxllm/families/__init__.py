"""Model families, one module each, registered by their Hugging Face architecture names
(`base.Family`: features, config quirks, tensor names, GGUF format). To add a family the
shared decoder already covers, write its module and import it here."""

from __future__ import annotations

from jaxllm.families import gemma, llama, mixtral, qwen  # noqa: F401  (they register)
from jaxllm.families.base import (
    FAMILIES,
    FULL_ATTENTION,
    GGUF_FAMILIES,
    GGUF_GLOBAL_NAMES,
    SLIDING_ATTENTION,
    Family,
    GGUFFormat,
)


def family_of(architecture: str) -> Family:
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(FAMILIES)}"
        ) from None


__all__ = [
    "FAMILIES",
    "FULL_ATTENTION",
    "GGUF_FAMILIES",
    "GGUF_GLOBAL_NAMES",
    "SLIDING_ATTENTION",
    "Family",
    "GGUFFormat",
    "family_of",
]

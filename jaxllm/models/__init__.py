"""Model classes and the registry from Hugging Face `architectures` names to them.

Every family of `jaxllm.families` runs on the one config-driven decoder; a family whose
layers the decoder cannot express gets a class of its own here."""

from __future__ import annotations

from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.families import FAMILIES
from jaxllm.models.decoder import DecoderForCausalLM
from jaxllm.models.layers import AttentionMetadata
from jaxllm.models.state import ModelCache, StepExtras

MODEL_REGISTRY: dict[str, type[nnx.Module]] = {
    arch: DecoderForCausalLM for arch, family in FAMILIES.items() if family.text_of is None
}


def get_model_class(config: ModelConfig) -> type[nnx.Module]:
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {config.architecture!r}; "
            f"supported: {', '.join(MODEL_REGISTRY)}"
        ) from None


__all__ = [
    "MODEL_REGISTRY",
    "AttentionMetadata",
    "DecoderForCausalLM",
    "ModelCache",
    "StepExtras",
    "get_model_class",
]

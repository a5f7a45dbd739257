"""Model classes and the registry from Hugging Face `architectures` names to them."""

from __future__ import annotations

from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.models.layers import AttentionMetadata
from jaxllm.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nnx.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def get_model_class(config: ModelConfig) -> type[nnx.Module]:
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {config.architecture!r}; "
            f"supported: {', '.join(MODEL_REGISTRY)}"
        ) from None


__all__ = ["MODEL_REGISTRY", "AttentionMetadata", "LlamaForCausalLM", "get_model_class"]

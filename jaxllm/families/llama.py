"""Llama 2/3 (and SmolLM2, which is a Llama) and Mistral: the decoder's own layout. A GGUF file
of architecture "llama" with experts is a Mixtral (llama.cpp writes Mixtral so)."""

from __future__ import annotations

from jaxllm.families.base import GGUF_EXPERT_NAMES, GGUF_LAYER_NAMES, Family, GGUFFormat, register


def _mixtral_if_routed(reader, config: dict) -> dict:
    if not config.get("num_local_experts"):
        return {}
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}


register(
    Family(
        "LlamaForCausalLM",
        gguf=GGUFFormat(
            "llama",
            "llama",
            GGUF_LAYER_NAMES | GGUF_EXPERT_NAMES,
            permuted_qk=True,
            read_config=_mixtral_if_routed,
        ),
    ),
    # Every layer slides when the config has a window.
    Family(
        "MistralForCausalLM",
        gguf=GGUFFormat("mistral", "mistral", GGUF_LAYER_NAMES, permuted_qk=True),
    ),
)

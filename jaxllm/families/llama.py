"""Llama 2/3 (and SmolLM2, which is a Llama) and Mistral: the decoder's own layout."""

from __future__ import annotations

from jaxllm.families.base import GGUF_LAYER_NAMES, Family, GGUFFormat, register

register(
    Family(
        "LlamaForCausalLM",
        gguf=GGUFFormat("llama", "llama", GGUF_LAYER_NAMES, permuted_qk=True),
    ),
    # Every layer slides when the config has a window.
    Family(
        "MistralForCausalLM",
        gguf=GGUFFormat("mistral", "mistral", GGUF_LAYER_NAMES, permuted_qk=True),
    ),
)

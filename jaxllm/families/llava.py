"""LLaVA (`LlavaForConditionalGeneration`): a CLIP or SigLIP vision tower and an MLP projector
(`jaxllm.models.vision`) before a decoder of one of the text families, which its
`text_config` names (Llama, Mistral, Qwen2)."""

from __future__ import annotations

from jaxllm.families.base import Family, register

register(Family("LlavaForConditionalGeneration", text_of="LlamaForCausalLM"))

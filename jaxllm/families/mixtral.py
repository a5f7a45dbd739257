"""Mixtral: Mistral's decoder with a mixture of experts in every layer."""

from __future__ import annotations

import re

from jaxllm.families.base import Family, register

# Mixtral's MoE names -> the ones the loader knows (Qwen3-MoE's): block_sparse_moe.gate is the
# router, experts.N.w1 / w3 / w2 are gate / up / down.
_MOE = re.compile(
    r"^(model\.layers\.\d+\.)block_sparse_moe\.(gate|experts\.\d+\.(w[123]))\.weight$"
)
_EXPERT_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _tensor_name(name: str) -> str:
    m = _MOE.match(name)
    if m is None:
        return name
    layer, part, projection = m.groups()
    if projection is not None:
        part = part[: -len(projection)] + _EXPERT_PROJECTIONS[projection]
    return f"{layer}mlp.{part}.weight"


register(Family("MixtralForCausalLM", {"moe_renormalize": True}, tensor_name=_tensor_name))

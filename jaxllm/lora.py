"""LoRA adapters in PEFT's format, as vLLM serves them: `LoRARequest` names one, and
`load_adapter` reads its `adapter_config.json` and `adapter_model.safetensors` into the
matrices the step adds to the base model's projections.

For a target projection y = x W, an adapter adds `x A B * scaling`: A [in, r] and B [r, out]
(PEFT stores them transposed, `lora_A.weight` [r, in] and `lora_B.weight` [out, r]); scaling
is `lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA. Here B is kept pre-multiplied by
the scaling, in float32. Targets: the attention's q, k, v and o projections and the MLP's
gate, up and down ones (the attention's only on a mixture of experts), of any subset of the
layers; adapters that also train the embeddings or the head (`modules_to_save`,
`embed_tokens`, `lm_head`), DoRA, bias training or other PEFT types are refused with the
reason.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from jaxllm.config import ModelConfig

# PEFT's module names -> where the projection is in this engine's layers.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r".*layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request (vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`):
    `lora_name` identifies it (a server's `model` field), `lora_path` is its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")


@dataclasses.dataclass
class LoRAAdapter:
    """An adapter's matrices by (layer, target): (A f32[in, r], B f32[r, out] times the
    scaling), in the checkpoint's layout."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


@dataclasses.dataclass(frozen=True)
class BaseDims:
    """The base model's widths an adapter must match, in the checkpoint's layout."""

    num_layers: int
    hidden: int
    q: int  # query heads x head_dim
    kv: int  # kv heads x head_dim (as the checkpoint has them: not repeated)
    intermediate: int
    moe: bool

    @classmethod
    def of(cls, config: ModelConfig) -> BaseDims:
        if config.heads_vary_by_layer or config.kv_shared_layers or config.attention_k_eq_v:
            raise ValueError(
                f"enable_lora: adapters of {config.architecture} are not served: its layers "
                "differ in head width, kv heads or keep no KV of their own (Gemma 4)"
            )
        if config.latent_attention is not None:
            raise ValueError(
                f"enable_lora: adapters of {config.architecture} are not served: its attention "
                "is latent attention (no q/k/v projections of the usual shapes)"
            )
        h = config.head_dim
        return cls(
            config.num_layers,
            config.hidden_size,
            config.num_heads * h,
            config.num_kv_heads // config.kv_head_replicas * h,
            config.intermediate_size,
            bool(config.num_experts),
        )

    @classmethod
    def of_hf_config(cls, hf: dict) -> BaseDims:
        """From a checkpoint's config.json (what a server's front end reads, without JAX)."""
        hf = hf.get("text_config") or hf
        heads = hf["num_attention_heads"]
        h = hf.get("head_dim") or hf["hidden_size"] // heads
        return cls(
            hf["num_hidden_layers"],
            hf["hidden_size"],
            heads * h,
            hf.get("num_key_value_heads", heads) * h,
            hf.get("intermediate_size", 0),
            bool(hf.get("num_experts") or hf.get("num_local_experts")),
        )

    def shape(self, target: str) -> tuple[int, int]:
        """(in, out) of a target projection."""
        d, f = self.hidden, self.intermediate
        return {
            "q_proj": (d, self.q),
            "k_proj": (d, self.kv),
            "v_proj": (d, self.kv),
            "o_proj": (self.q, d),
            "gate_proj": (d, f),
            "up_proj": (d, f),
            "down_proj": (f, d),
        }[target]


def load_adapter(path: str | Path, dims: BaseDims | None, *, max_rank: int, name: str = ""):
    """The PEFT LoRA adapter at `path` for a base model of `dims` (None: not known, as for a
    GGUF file's front end: every check but the shapes); ValueError (naming the file and the
    reason) for anything this engine does not serve."""
    from jaxllm.loaders.hf import iter_safetensors

    path = Path(path)
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"lora_path {path}: no adapter_config.json (a PEFT adapter directory)")
    try:
        meta = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"lora_path {path}: adapter_config.json is not JSON: {e}") from e
    if (kind := meta.get("peft_type", "LORA")) != "LORA":
        raise ValueError(f"lora_path {path}: peft_type {kind} is not LoRA")
    if not (path / "adapter_model.safetensors").is_file():
        raise ValueError(f"lora_path {path}: no adapter_model.safetensors")
    for key, why in (
        ("modules_to_save", "trains modules besides LoRA matrices (modules_to_save)"),
        ("use_dora", "is a DoRA adapter"),
    ):
        if meta.get(key):
            raise ValueError(f"lora_path {path}: the adapter {why}, which is not supported")
    if meta.get("bias", "none") != "none":
        raise ValueError(f"lora_path {path}: the adapter trains biases, which is not supported")
    rank = int(meta.get("r", 8))
    if not 1 <= rank <= max_rank:
        raise ValueError(f"lora_path {path}: rank {rank} is over max_lora_rank ({max_rank})")
    alpha = float(meta.get("lora_alpha", rank))
    scaling = alpha / (math.sqrt(rank) if meta.get("use_rslora") else rank)
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in iter_safetensors(path):
        m = _KEY.match(key)
        if m is None:
            raise ValueError(
                f"lora_path {path}: tensor {key} is not a LoRA matrix of {', '.join(TARGETS)} "
                "(adapters of the embeddings or the head are not supported)"
            )
        layer, target, half = int(m[1]), m[2], m[3]
        if target not in TARGETS:
            raise ValueError(f"lora_path {path}: target module {target} is not one of {TARGETS}")
        if dims is not None and dims.moe and target in ("gate_proj", "up_proj", "down_proj"):
            raise ValueError(
                f"lora_path {path}: adapters of a mixture-of-experts model's MLP ({target}) are "
                "not supported; its attention's are"
            )
        if dims is not None and layer >= dims.num_layers:
            raise ValueError(f"lora_path {path}: layer {layer} of {dims.num_layers}")
        halves.setdefault((layer, target), {})[half] = np.asarray(tensor, np.float32)
    if not halves:
        raise ValueError(f"lora_path {path}: adapter_model.safetensors has no LoRA matrices")
    weights = {}
    for (layer, target), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"lora_path {path}: layer {layer} {target} lacks lora_A or lora_B")
        a, b = pair["A"].T, pair["B"].T * scaling  # [in, r], [r, out]
        num_in, num_out = dims.shape(target) if dims is not None else (a.shape[0], b.shape[1])
        want = (num_in, rank), (rank, num_out)
        if (a.shape, b.shape) != want:
            raise ValueError(
                f"lora_path {path}: layer {layer} {target} has A {a.shape} and B {b.shape}, "
                f"the base model needs {want[0]} and {want[1]} (an adapter of another model?)"
            )
        weights[layer, target] = (np.ascontiguousarray(a), np.ascontiguousarray(b))
    return LoRAAdapter(name or path.name, rank, weights)

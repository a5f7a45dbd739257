"""Pooling a sequence's hidden states into one vector, as a checkpoint says.

vLLM's names: `pooling_type` "MEAN" (the average over the sequence's tokens), "CLS" (its first
token's state), "LAST" (its last token's: decoder embedders such as Qwen3-Embedding), and
`normalize` (L2, to unit length). A sentence-transformers checkpoint says which in
`modules.json` (a `Pooling` module and its `config.json`, then `Normalize` or not); a
`--pooler-config` JSON overrides what the checkpoint says.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp

POOLING_TYPES = ("MEAN", "CLS", "LAST")
# sentence-transformers' Pooling config keys, by the pooling type each turns on.
_ST_MODES = {
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_lasttoken": "LAST",
}


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "MEAN"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                f"{self.pooling_type!r}"
            )

    @classmethod
    def from_json(cls, text: str | dict, base: PoolerConfig | None = None) -> PoolerConfig:
        """`--pooler-config`'s JSON (vLLM's keys `pooling_type`, `normalize`) over `base`."""
        data = json.loads(text) if isinstance(text, str) else dict(text)
        unknown = set(data) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"pooler_config: unknown keys {sorted(unknown)}")
        base = base or cls()
        if "pooling_type" in data:
            data["pooling_type"] = str(data["pooling_type"]).upper()
        return dataclasses.replace(base, **data)


def read_pooler_config(path: str | Path, default: PoolerConfig | None = None) -> PoolerConfig:
    """What a checkpoint directory says of its pooling: sentence-transformers' `modules.json`
    (its Pooling module's config, and whether a Normalize module follows), else `default`
    (mean pooling, normalized)."""
    path = Path(path)
    default = default or PoolerConfig()
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return default
    modules = json.loads(modules_file.read_text())
    types = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    pooling_type = default.pooling_type
    for module in modules:
        if module.get("type", "").endswith("Pooling"):
            config = json.loads((path / module.get("path", "") / "config.json").read_text())
            chosen = [t for key, t in _ST_MODES.items() if config.get(key)]
            others = [k for k, v in config.items() if k.startswith("pooling_mode") and v]
            if len(chosen) != 1 or len(others) != 1:
                raise ValueError(
                    f"{path}: pooling modes {others} are not supported (one of "
                    f"{', '.join(_ST_MODES)})"
                )
            pooling_type = chosen[0]
    return PoolerConfig(pooling_type, normalize="Normalize" in types)


def read_max_seq_length(path: str | Path) -> int | None:
    """sentence-transformers' `max_seq_length` (the length it truncates to), if the checkpoint
    directory has one."""
    f = Path(path) / "sentence_bert_config.json"
    if not f.is_file():
        return None
    return json.loads(f.read_text()).get("max_seq_length")


def pool(hidden: jax.Array, lengths: jax.Array, config: PoolerConfig) -> jax.Array:
    """`hidden[B, T, D]` of sequences `lengths[B]` long (the rest padding) -> float32 `[B, D]`."""
    hidden = hidden.astype(jnp.float32)
    if config.pooling_type == "MEAN":
        mask = (jnp.arange(hidden.shape[1])[None, :] < lengths[:, None]).astype(jnp.float32)
        out = jnp.einsum("btd,bt->bd", hidden, mask) / jnp.maximum(lengths, 1)[:, None]
    elif config.pooling_type == "CLS":
        out = hidden[:, 0]
    else:  # LAST
        out = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    if config.normalize:
        # sentence-transformers' Normalize: x / max(|x|, 1e-12).
        out = out / jnp.maximum(jnp.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
    return out

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

import numpy as np

from jaxllm.classifier import ClassifierHead
from jaxllm.loaders.hf import checkpoint_architectures

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
    modules = _st_modules(path)
    if modules is None:
        return default
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


def _st_modules(path: Path) -> list[dict] | None:
    """sentence-transformers' `modules.json` of a checkpoint directory, if it has one."""
    modules_file = path / "modules.json"
    return json.loads(modules_file.read_text()) if modules_file.is_file() else None


def has_pooling_module(path: str | Path) -> bool:
    """Whether sentence-transformers' `modules.json` in the checkpoint directory pools it."""
    modules = _st_modules(Path(path)) or []
    return any(str(m.get("type", "")).endswith("Pooling") for m in modules)


def decoder_pools(path: str | Path, runner: str) -> bool:
    """Whether a decoder checkpoint is served for pooling under `runner` (see
    `LoadConfig.runner`): asked for, or (auto) its sentence-transformers files pool it or it
    is a base model without an LM head (Qwen3Model, MistralModel: vLLM's rule)."""
    if runner != "auto":
        return runner == "pooling"
    return has_pooling_module(path) or not has_lm_head(path)


def has_lm_head(path: str | Path) -> bool:
    """False for a Hugging Face base model's checkpoint (architectures `*Model`): no LM head
    (a GGUF file, an orbax checkpoint: a generative model's, with one)."""
    return not any(a.endswith("Model") for a in checkpoint_architectures(path) or ())


def resolve_pooler_config(
    path: str | Path, override: str | None, default: PoolerConfig | None = None
) -> PoolerConfig:
    """The checkpoint's pooling (`read_pooler_config`, else `default`), with the
    `--pooler-config` JSON `override` over it."""
    config = read_pooler_config(path, default) if Path(path).is_dir() else default or PoolerConfig()
    return config if override is None else PoolerConfig.from_json(override, config)


# What a decoder served for pooling with no sentence-transformers files does (vLLM's default
# for embedding with a decoder: its last token, normalized).
DECODER_POOLER = PoolerConfig("LAST", normalize=True)
# What a classifier's head reads: an encoder's first token, a decoder's last, as they are.
ENCODER_CLASSIFIER_POOLER = PoolerConfig("CLS", normalize=False)
DECODER_CLASSIFIER_POOLER = PoolerConfig("LAST", normalize=False)


def supported_tasks(head: ClassifierHead | None) -> list[str]:
    """What a pooling model serves, by vLLM's task names: an embedder encodes, embeds and
    scores pairs by cosine similarity; a classifier classifies, and scores pairs (a
    cross-encoder's relevance) when it has one label."""
    if head is None:
        return ["encode", "embed", "score"]
    return ["classify", "score"] if head.num_labels == 1 else ["classify"]


def check_params(params, hidden_size: int, head: ClassifierHead | None) -> None:
    """Raises a ValueError naming the field for `PoolingParams` this model cannot honour."""
    params.check(hidden_size)
    if head is not None and params.dimensions is not None:
        raise ValueError(
            "dimensions applies to embeddings; this model classifies (its outputs are its "
            f"{head.num_labels} labels' scores)"
        )


@dataclasses.dataclass
class PooledState:
    """A pooling request's running pool over the chunks of its prompt computed so far: the
    sum of their hidden states, the last one, and their count (reset when it is preempted,
    since its prompt is then computed again)."""

    config: PoolerConfig
    head: ClassifierHead | None = None  # a classifier's head over the pooled state
    total: np.ndarray | None = None
    last: np.ndarray | None = None
    num_tokens: int = 0

    def add(self, total: np.ndarray, last: np.ndarray, num_tokens: int) -> None:
        self.total = total if self.total is None else self.total + total
        self.last = last
        self.num_tokens += num_tokens

    def reset(self) -> None:
        self.total, self.last, self.num_tokens = None, None, 0

    def finish(self, params) -> np.ndarray:
        """The request's output: its pooled vector as `params` ask (see `finish_vector`)."""
        return finish_vector(self.pooled(), params, self.config, self.head)

    def pooled(self) -> np.ndarray:
        """The sequence's vector as its pooling type says, not normalized."""
        if self.config.pooling_type == "MEAN":
            return self.total / max(self.num_tokens, 1)
        if self.config.pooling_type == "LAST":
            return self.last
        raise ValueError("CLS pooling is an encoder's: a decoder's first token sees no other")


def finish_vector(
    vector: np.ndarray, params, config: PoolerConfig, head: ClassifierHead | None = None
) -> np.ndarray:
    """A pooled vector as the request's `PoolingParams` ask: a classifier's label scores
    (`ClassifierHead.outputs`), or an embedding's first `dimensions`, then normalized (as the
    pooler config says, unless the request says otherwise)."""
    if head is not None:
        return head.outputs(vector, activation=params.activation is not False)
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    normalize = config.normalize if params.normalize is None else params.normalize
    if normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return np.asarray(vector, np.float32)


def read_max_seq_length(path: str | Path) -> int | None:
    """sentence-transformers' `max_seq_length` (the length it truncates to), if the checkpoint
    directory has one."""
    f = Path(path) / "sentence_bert_config.json"
    if not f.is_file():
        return None
    return json.loads(f.read_text()).get("max_seq_length")


def pool(hidden, lengths, config: PoolerConfig):
    """`hidden[B, T, D]` of sequences `lengths[B]` long (the rest padding) -> float32 `[B, D]`
    (traced inside the encoder's programs; JAX is imported here, so that the front end, which
    reads the pooling config, does not load it)."""
    import jax.numpy as jnp

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

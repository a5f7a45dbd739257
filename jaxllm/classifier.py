"""Sequence classification heads (`*ForSequenceClassification` checkpoints: BERT and RoBERTa
cross-encoders, Qwen2/Qwen3/Llama rerankers and classifiers), applied on the host to the
sequence's pooled hidden state: the first token's for an encoder (CLS), the last token's for a
decoder.

- BERT: its pooler (`tanh(dense(x))`), then `classifier`;
- RoBERTa, XLM-R: `classifier.dense`, tanh, then `classifier.out_proj` (the same shape);
- decoders: `score`, with no bias.

The outputs are the labels' probabilities (vLLM's `classify`): a sigmoid of the one logit of a
single-label head (a cross-encoder's relevance score), otherwise a softmax over the labels;
the raw logits with `PoolingParams(activation=False)`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxllm.loaders.hf import iter_safetensors

_SUFFIX = "ForSequenceClassification"
# Tensor names of each kind of head: (dense weight, dense bias, out weight, out bias).
_HEADS = (
    ("bert.pooler.dense.weight", "bert.pooler.dense.bias", "classifier.weight", "classifier.bias"),
    ("classifier.dense.weight", "classifier.dense.bias", "classifier.out_proj.weight",
     "classifier.out_proj.bias"),
    (None, None, "score.weight", None),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ClassifierHead:
    weight: np.ndarray  # f32[L, D]
    bias: np.ndarray | None  # f32[L]
    dense: tuple[np.ndarray, np.ndarray] | None  # (f32[D, D], f32[D]): tanh(W x + b) first
    labels: tuple[str, ...]  # id2label, in order

    @property
    def num_labels(self) -> int:
        return len(self.weight)

    def logits(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32)
        if self.dense is not None:
            x = np.tanh(self.dense[0] @ x + self.dense[1])
        out = self.weight @ x
        return out if self.bias is None else out + self.bias

    def outputs(self, x: np.ndarray, activation: bool = True) -> np.ndarray:
        """The labels' probabilities (or logits, without `activation`) of pooled state `x`."""
        logits = self.logits(x).astype(np.float64)
        if not activation:
            return logits.astype(np.float32)
        if self.num_labels == 1:
            return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        e = np.exp(logits - logits.max())
        return (e / e.sum()).astype(np.float32)


def is_classifier(hf_config: dict) -> bool:
    return any(a.endswith(_SUFFIX) for a in hf_config.get("architectures") or [])


def read_classifier(path: str | Path) -> ClassifierHead | None:
    """The classification head of a checkpoint directory, or None if it has none."""
    path = Path(path)
    config_file = path / "config.json"
    if not path.is_dir() or not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    if not is_classifier(config):
        return None
    wanted = {n for head in _HEADS for n in head if n is not None}
    tensors = {n: np.asarray(t, np.float32) for n, t in iter_safetensors(path, wanted)}
    for dense_w, dense_b, out_w, out_b in _HEADS:
        if out_w not in tensors:
            continue
        dense = None
        if dense_w is not None:
            if dense_w not in tensors:
                continue
            dense = (tensors[dense_w], tensors[dense_b])
        weight = tensors[out_w]
        id2label = config.get("id2label") or {}
        labels = tuple(str(id2label.get(str(i), f"LABEL_{i}")) for i in range(len(weight)))
        return ClassifierHead(weight, tensors.get(out_b) if out_b else None, dense, labels)
    raise ValueError(
        f"{path}: a sequence classification checkpoint without a head this engine reads "
        "(bert.pooler + classifier, classifier.dense + out_proj, or score)"
    )

"""BERT-style encoders (BERT, RoBERTa, XLM-R): bidirectional attention over each sequence's own
tokens, for pooling models (embeddings, classification).

An encoder keeps no KV cache: a sequence is encoded whole, in one program, and its hidden states
are pooled (`jaxllm.pooling`). Sequences come as a padded batch `ids[B, T]` with their
`lengths[B]`; a padding key is masked out of every query's softmax, and padding rows compute
values nobody reads. Positions are absolute (learned embeddings), from `position_offset`:
0 for BERT, `pad_token_id + 1` for RoBERTa and XLM-R, whose position ids count from there.

The layers follow Hugging Face's `BertModel` (post-layer-norm: each sublayer's output is added
to its input, then normalized), so a checkpoint's tensors load as they are
(`jaxllm.loaders.encoder.load_encoder`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.models.layers import LayerNorm

# Hugging Face's `architectures` names this module serves, by `model_type`.
ENCODER_ARCHITECTURES = {
    "BertModel": "bert",
    "RobertaModel": "roberta",
    "XLMRobertaModel": "xlm-roberta",
    # Cross-encoders and classifiers: the encoder, then a head (`jaxllm.classifier`).
    "BertForSequenceClassification": "bert",
    "RobertaForSequenceClassification": "roberta",
    "XLMRobertaForSequenceClassification": "xlm-roberta",
}
_ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """What an encoder's `config.json` says of its shape (Hugging Face's names in comments)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    position_offset: int = 0
    """The first position id: 0 for BERT, pad_token_id + 1 for RoBERTa and XLM-R."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"encoder config: hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_heads})"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"encoder config: hidden_act must be one of {', '.join(_ACTIVATIONS)}, got "
                f"{self.hidden_act!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_len(self) -> int:
        """The longest sequence the position embeddings cover."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf(cls, hf: dict) -> EncoderConfig:
        arch = (hf.get("architectures") or [""])[0]
        model_type = hf.get("model_type") or ENCODER_ARCHITECTURES.get(arch, "")
        if arch not in ENCODER_ARCHITECTURES and model_type not in ENCODER_ARCHITECTURES.values():
            raise ValueError(
                f"not an encoder this engine runs: architectures {hf.get('architectures')}, "
                f"model_type {model_type!r}; supported: {', '.join(ENCODER_ARCHITECTURES)}"
            )
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"encoder config: position_embedding_type {hf['position_embedding_type']!r} "
                "is not supported (absolute only)"
            )
        pad = int(hf.get("pad_token_id") or 0)
        return cls(
            architecture=arch or {v: k for k, v in ENCODER_ARCHITECTURES.items()}[model_type],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            max_position_embeddings=hf["max_position_embeddings"],
            type_vocab_size=hf.get("type_vocab_size", 2),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
            hidden_act=hf.get("hidden_act", "gelu"),
            pad_token_id=pad,
            position_offset=pad + 1 if model_type in ("roberta", "xlm-roberta") else 0,
        )


def _zeros(shape, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


class _Dense(nnx.Module):
    def __init__(self, num_in: int, num_out: int, dtype):
        self.weight = _zeros((num_in, num_out), dtype)  # [in, out]: torch's transposed
        self.bias = _zeros((num_out,), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.weight.get_value() + self.bias.get_value()


class _Layer(nnx.Module):
    def __init__(self, c: EncoderConfig, dtype):
        d, f = c.hidden_size, c.intermediate_size
        self.query, self.key, self.value = (_Dense(d, d, dtype) for _ in range(3))
        self.attention_output = _Dense(d, d, dtype)
        self.attention_norm = LayerNorm(d, c.layer_norm_eps, dtype=dtype)
        self.intermediate = _Dense(d, f, dtype)
        self.output = _Dense(f, d, dtype)
        self.output_norm = LayerNorm(d, c.layer_norm_eps, dtype=dtype)
        self.num_heads = c.num_heads
        self.act = _ACTIVATIONS[c.hidden_act]

    def __call__(self, x: jax.Array, key_mask: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = d // self.num_heads

        def heads(y):
            return y.reshape(b, t, self.num_heads, h)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        scores = jnp.einsum("bqnh,bknh->bnqk", q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(key_mask[:, None, None, :], scores * h**-0.5, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        ctx = jnp.einsum("bnqk,bknh->bqnh", probs, v).reshape(b, t, d)
        x = self.attention_norm(x + self.attention_output(ctx))
        return self.output_norm(x + self.output(self.act(self.intermediate(x))))


class BertEncoder(nnx.Module):
    """The encoder: embeddings (word, absolute position, token type) and `num_layers` layers.
    `__call__(ids[B, T], lengths[B], type_ids[B, T] or None)` -> hidden states `[B, T, D]`
    (padding rows past a sequence's length hold values nobody should read)."""

    def __init__(self, config: EncoderConfig, *, dtype=jnp.float32):
        c = self.config = config
        d = c.hidden_size
        self.word_embeddings = _zeros((c.vocab_size, d), dtype)
        self.position_embeddings = _zeros((c.max_position_embeddings, d), dtype)
        self.token_type_embeddings = _zeros((c.type_vocab_size, d), dtype)
        self.embedding_norm = LayerNorm(d, c.layer_norm_eps, dtype=dtype)
        self.layers = nnx.List([_Layer(c, dtype) for _ in range(c.num_layers)])

    def __call__(
        self, ids: jax.Array, lengths: jax.Array, type_ids: jax.Array | None = None
    ) -> jax.Array:
        t = ids.shape[1]
        positions = jnp.arange(t) + self.config.position_offset
        if type_ids is None:
            type_ids = jnp.zeros_like(ids)
        x = (
            self.word_embeddings.get_value()[ids]
            + self.position_embeddings.get_value()[positions][None]
            + self.token_type_embeddings.get_value()[type_ids]
        )
        x = self.embedding_norm(x)
        key_mask = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T]
        for layer in self.layers:
            x = layer(x, key_mask)
        return x

"""Vision towers and their projectors: an image's pixels -> embeddings in the decoder's width,
one per placeholder token of the image in the prompt.

The tower is a ViT as CLIP and SigLIP write it (patch embedding as one matmul over flattened
patches, learned absolute positions, pre-norm layers with biased attention and a two-layer
MLP); `VisionConfig` switches what differs (CLIP's class token and pre-layernorm, SigLIP's
post-layernorm, the activation). Only the layers up to the one whose hidden states the model
reads are built and run (LLaVA reads the second to last: the last is never computed).

The projector maps the tower's features into the decoder: LLaVA's two-layer MLP, or Gemma 3's
average pooling of the patch grid (to `mm_tokens_per_image`), soft-embedding norm and matrix.
An image is always encoded whole, `tokens_per_image` rows: the engine runs the encoder once per
image and keeps its rows in a device-side cache (`jaxllm.worker.mm_encoder`). Gemma 3's image
tokens attend to each other in the decoder (`bidirectional`: the engine computes an image in
one chunk and widens the attention's causal order over it, `AttentionMetadata.attend_to`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.models.layers import ACTIVATIONS, LayerNorm, RMSNorm, param

_ACTIVATIONS = {
    **ACTIVATIONS,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """An image-text model's vision side, read from its Hugging Face config
    (`from_hf_config`)."""

    architecture: str  # the image-text model's, e.g. "LlavaForConditionalGeneration"
    hidden_size: int
    intermediate_size: int
    num_layers: int  # the tower's layers that run (up to the feature layer)
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    class_token: bool  # CLIP: a class embedding before the patches
    pre_norm: bool  # CLIP's pre_layrnorm on the embeddings
    post_norm: bool  # the final layernorm on the features read (SigLIP's last_hidden_state)
    drop_class_token: bool  # LLaVA's "default" feature strategy: the class token's row dropped
    text_hidden_size: int
    projector_act: str
    projector_bias: bool
    image_token_id: int
    projector: str = "llava"  # "llava": the MLP; "gemma3": pooled, normed, one matrix
    mm_tokens_per_image: int = 0  # gemma3: the pooled grid's tokens

    dynamic = False  # every image the same size: `tokens_per_image` rows

    @property
    def bidirectional(self) -> bool:
        """The decoder's image tokens attend to each other (Gemma 3)."""
        return self.projector == "gemma3"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        """The rows an image becomes, and the placeholder tokens it takes in the prompt."""
        if self.projector == "gemma3":
            return self.mm_tokens_per_image
        return self.num_patches + (self.class_token and not self.drop_class_token)

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        """One image's pixel array, as the model's image processor makes it: [C, H, W]."""
        return (self.num_channels, self.image_size, self.image_size)

    # What the engine asks of every vision side (`jaxllm.models.qwen_vision` has the same).
    @property
    def max_tokens_per_image(self) -> int:
        return self.tokens_per_image

    @property
    def block_tokens(self) -> int:
        """The encoder cache's allocation unit, in rows: an image."""
        return self.tokens_per_image

    def tokens_of(self, shape) -> int | None:
        """The tokens of an image whose pixels have this shape, or None if the model takes no
        such array."""
        return self.tokens_per_image if list(shape) == list(self.pixel_shape) else None

    def embeds_tokens(self, shape) -> int | None:
        """The tokens of an image given as embeddings of this shape ([tokens, width]), or
        None if the model takes no such array."""
        return (
            self.tokens_per_image
            if list(shape) == [self.tokens_per_image, self.text_hidden_size]
            else None
        )

    @property
    def pixel_shape_text(self) -> str:
        return str(list(self.pixel_shape))

    def split_pixels(self, processed) -> list[np.ndarray]:
        """Each image's pixels from its HF processor's output (`pixel_values` [B, C, H, W])."""
        return list(np.asarray(processed["pixel_values"], np.float32))

    # How the encoder's launches are laid out (`jaxllm.worker.mm_encoder`).
    def encoder_buckets(self, num_blocks: int, budget: int) -> list[int]:
        """Images per launch: powers of two up to the most a step encodes (budget, cache)."""
        most = max(1, min(num_blocks, budget // self.tokens_per_image))
        buckets = [1 << i for i in range(most.bit_length())]
        return buckets if buckets[-1] == most else [*buckets, most]

    def launch_size(self, shape) -> int:
        """An image's share of a launch's bucket: one image."""
        return 1

    def pack(self, images: list, bucket: int, drop: int) -> tuple[np.ndarray, np.ndarray]:
        """The encoder's (rows, pixels) for `images`, (pixels [C, H, W], their tokens' cache
        rows) pairs, padded to `bucket` images; padding writes to row `drop` (dropped)."""
        pixels = np.zeros((bucket, *self.pixel_shape), np.float32)
        rows = np.full((bucket, self.tokens_per_image), drop, np.int32)
        for i, (image, image_rows) in enumerate(images):
            pixels[i] = image
            rows[i] = image_rows[: self.tokens_per_image]
        return rows.reshape(-1), pixels

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> VisionConfig:
        arch = (config.get("architectures") or ["?"])[0]
        if arch == "Gemma3ForConditionalGeneration":
            return cls._gemma3(config)
        if arch != "LlavaForConditionalGeneration":
            raise ValueError(f"{arch}: no vision tower of this architecture is supported")
        vision, text = config["vision_config"], config["text_config"]
        kind = vision.get("model_type", "clip_vision_model")
        if kind not in ("clip_vision_model", "siglip_vision_model"):
            raise ValueError(f"vision_config: model_type {kind!r} is not supported")
        clip = kind == "clip_vision_model"
        layers = vision["num_hidden_layers"]
        # hidden_states[k]: the embeddings (k = 0) or the output of layer k.
        feature = config.get("vision_feature_layer", -2)
        if not isinstance(feature, int):
            raise ValueError("vision_feature_layer: a list of layers is not supported")
        run = feature if feature >= 0 else layers + 1 + feature
        if not 0 <= run <= layers:
            raise ValueError(f"vision_feature_layer {feature} is outside the tower's layers")
        strategy = config.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported")
        image_token = config.get("image_token_id", config.get("image_token_index"))
        if image_token is None:
            raise ValueError("an image-text config needs image_token_id")
        return cls(
            architecture=arch,
            **_tower(vision, text, clip=clip),
            num_layers=run,
            class_token=clip,
            pre_norm=clip,
            post_norm=False,  # hidden_states[k] are read before the tower's final norm
            drop_class_token=clip and strategy == "default",
            projector_act=config.get("projector_hidden_act", "gelu"),
            projector_bias=config.get("multimodal_projector_bias", True),
            image_token_id=int(image_token),
        )

    @classmethod
    def _gemma3(cls, config: dict[str, Any]) -> VisionConfig:
        """Gemma 3 (4B-27B): SigLIP's last hidden state (after its final norm), pooled."""
        vision, text = config["vision_config"], config["text_config"]
        tokens = config.get("mm_tokens_per_image", 256)
        side = int(round(tokens**0.5))
        patches = vision["image_size"] // vision["patch_size"]
        if side * side != tokens or patches % side:
            raise ValueError(
                f"mm_tokens_per_image {tokens} must be a square whose side divides the "
                f"{patches} patches per side"
            )
        image_token = config.get("image_token_id", config.get("image_token_index", 262144))
        return cls(
            architecture="Gemma3ForConditionalGeneration",
            **_tower(vision, text, clip=False),
            num_layers=vision["num_hidden_layers"],
            class_token=False,
            pre_norm=False,
            post_norm=True,
            drop_class_token=False,
            projector_act="",
            projector_bias=False,
            image_token_id=int(image_token),
            projector="gemma3",
            mm_tokens_per_image=tokens,
        )


def _tower(vision: dict[str, Any], text: dict[str, Any], *, clip: bool) -> dict[str, Any]:
    """The `VisionConfig` fields every tower reads alike from its `vision_config` (CLIP's
    defaults or SigLIP's), and the decoder's width."""
    return dict(
        hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"],
        num_heads=vision["num_attention_heads"],
        image_size=vision["image_size"],
        patch_size=vision["patch_size"],
        num_channels=vision.get("num_channels", 3),
        layer_norm_eps=vision.get("layer_norm_eps", 1e-5 if clip else 1e-6),
        hidden_act=vision.get("hidden_act", "quick_gelu" if clip else "gelu_pytorch_tanh"),
        text_hidden_size=text["hidden_size"],
    )


class Dense(nnx.Module):
    """x @ weight + bias, weight [in, out] (torch's transposed); `axes` its logical axes."""

    def __init__(self, num_in: int, num_out: int, axes, *, bias: bool = True, dtype, rngs):
        self.weight = param(rngs, (num_in, num_out), axes, dtype)
        self.bias = param(rngs, (num_out,), axes[1:], dtype) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum("...i,io->...o", x, self.weight.get_value())
        return y if self.bias is None else y + self.bias.get_value()


_COLUMNS = ("embed", "mlp")  # split on the output (heads, MLP width) under tensor parallelism
_ROWS = ("mlp", "embed")  # split on the input; XLA adds the all-reduce


class EncoderLayer(nnx.Module):
    def __init__(self, c: VisionConfig, *, dtype, rngs):
        d, f = c.hidden_size, c.intermediate_size
        self.layer_norm1 = LayerNorm(d, c.layer_norm_eps, dtype=dtype)
        self.q_proj, self.k_proj, self.v_proj = (
            Dense(d, d, _COLUMNS, dtype=dtype, rngs=rngs) for _ in range(3)
        )
        self.out_proj = Dense(d, d, _ROWS, dtype=dtype, rngs=rngs)
        self.layer_norm2 = LayerNorm(d, c.layer_norm_eps, dtype=dtype)
        self.fc1 = Dense(d, f, _COLUMNS, dtype=dtype, rngs=rngs)
        self.fc2 = Dense(f, d, _ROWS, dtype=dtype, rngs=rngs)
        self.num_heads = c.num_heads
        self.act = _ACTIVATIONS[c.hidden_act]

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, S, D]
        b, s, d = x.shape
        n = self.num_heads
        y = self.layer_norm1(x)
        q, k, v = (p(y).reshape(b, s, n, d // n) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = jnp.einsum("bqnh,bknh->bnqk", q, k, preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(scores * (d // n) ** -0.5, axis=-1).astype(x.dtype)
        ctx = jnp.einsum("bnqk,bknh->bqnh", probs, v).reshape(b, s, d)
        x = x + self.out_proj(ctx)
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class VisionTower(nnx.Module):
    """pixels f32[B, C, H, W] -> the features the projector reads [B, S, D_vision]."""

    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs | None):
        d, p = c.hidden_size, c.patch_size
        self.config = c
        # The patch convolution (stride = kernel = patch) as a matmul over flattened patches
        # in (channel, row, column) order: torch's [D, C, p, p] weight, reshaped.
        self.patch_embedding = Dense(
            c.num_channels * p * p,
            d,
            (None, "embed"),
            bias=not c.class_token,
            dtype=dtype,
            rngs=rngs,
        )
        self.class_embedding = param(rngs, (d,), ("embed",), dtype) if c.class_token else None
        positions = c.num_patches + c.class_token
        self.position_embedding = param(rngs, (positions, d), (None, "embed"), dtype)
        self.pre_layrnorm = LayerNorm(d, c.layer_norm_eps, dtype=dtype) if c.pre_norm else None
        self.layers = nnx.List(EncoderLayer(c, dtype=dtype, rngs=rngs) for _ in range(c.num_layers))
        self.post_layernorm = LayerNorm(d, c.layer_norm_eps, dtype=dtype) if c.post_norm else None

    def __call__(self, pixels: jax.Array) -> jax.Array:
        c = self.config
        b, ch, h, w = pixels.shape
        p = c.patch_size
        patches = pixels.reshape(b, ch, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5)
        weight = self.patch_embedding.weight.get_value()
        x = self.patch_embedding(patches.reshape(b, -1, ch * p * p).astype(weight.dtype))
        if self.class_embedding is not None:
            cls = jnp.broadcast_to(self.class_embedding.get_value(), (b, 1, x.shape[-1]))
            x = jnp.concatenate([cls, x], axis=1)
        x = x + self.position_embedding.get_value()[None]
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        for layer in self.layers:
            x = layer(x)
        if self.post_layernorm is not None:
            x = self.post_layernorm(x)
        return x[:, 1:] if c.drop_class_token else x


class LlavaProjector(nnx.Module):
    def __init__(self, c: VisionConfig, *, dtype, rngs):
        d, t = c.hidden_size, c.text_hidden_size
        self.linear_1 = Dense(d, t, _COLUMNS, bias=c.projector_bias, dtype=dtype, rngs=rngs)
        self.linear_2 = Dense(t, t, _ROWS, bias=c.projector_bias, dtype=dtype, rngs=rngs)
        self.act = _ACTIVATIONS[c.projector_act]

    def __call__(self, features: jax.Array) -> jax.Array:
        return self.linear_2(self.act(self.linear_1(features)))


class Gemma3Projector(nnx.Module):
    """The patch grid average-pooled to `mm_tokens_per_image` tokens, RMS-normed as Gemma
    norms ((1 + w), in float32), and projected by one matrix."""

    def __init__(self, c: VisionConfig, *, dtype, rngs):
        d = c.hidden_size
        self.mm_input_projection_weight = param(rngs, (d, c.text_hidden_size), _COLUMNS, dtype)
        self.mm_soft_emb_norm = RMSNorm(d, c.layer_norm_eps, offset=1.0, dtype=dtype)
        self.patches = c.image_size // c.patch_size
        self.kernel = self.patches // int(round(c.mm_tokens_per_image**0.5))

    def __call__(self, features: jax.Array) -> jax.Array:  # [B, S, D] -> [B, tokens, text]
        b, _, d = features.shape
        p, k = self.patches, self.kernel
        grid = features.astype(jnp.float32).reshape(b, p // k, k, p // k, k, d)
        pooled = grid.mean(axis=(2, 4)).reshape(b, -1, d).astype(features.dtype)
        weight = self.mm_input_projection_weight.get_value()
        return jnp.einsum("bsd,dt->bst", self.mm_soft_emb_norm(pooled), weight)


class VisionEncoder(nnx.Module):
    """An image-text model's image side: pixels f32[B, C, H, W] -> [B, tokens_per_image,
    text width], the rows that replace the image's placeholder tokens."""

    def __init__(self, config: VisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.config = config
        self.vision_tower = VisionTower(config, dtype=dtype, rngs=rngs)
        projector = Gemma3Projector if config.projector == "gemma3" else LlavaProjector
        self.multi_modal_projector = projector(config, dtype=dtype, rngs=rngs)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        return self.multi_modal_projector(self.vision_tower(pixels))

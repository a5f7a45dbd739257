"""Qwen2.5-VL's vision side: images at their own resolution, as a variable number of patches,
through a ViT with 2-D rotary positions and windowed attention, merged 2x2 into the decoder's
width (`Qwen2_5_VLForConditionalGeneration`); and Qwen2-VL's (`Qwen2VLForConditionalGeneration`),
the same without windows, with LayerNorms and a plain MLP.

An image of H x W pixels (resized by the processor to multiples of patch * merge) is a grid of
t x h x w patches (t = 1 for an image: the frame repeated over `temporal_patch_size`), and
becomes t * h/2 * w/2 tokens. The processor lays the patches out merge unit by merge unit (the
2 x 2 patches one token is made of, consecutive); `pixel_shape` keeps that as
[t, h/2, w/2, 4 * patch_dim], so an image's token grid is its array's first three axes.

Most layers attend within windows of `window_size` pixels (4 x 4 tokens); `fullatt_block_indexes`
attend over the whole frame. As transformers does, the patches run in window order (each
window's merge units contiguous) and the tokens go back to raster order at the end: here the
host puts the patches in window order (`pack`) and the encoder writes each token to its row of
the encoder cache, so no permutation runs on the device. A step's images run as one padded
sequence of patches, attention masked to the same window or frame (`segment` ids), by chunks of
queries: a windowed layer's chunk against the keys within a window's length of it, a full
layer's against every key of the sequence (dense: O(patches^2) per full layer).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.models.layers import LayerNorm, RMSNorm, param
from jaxllm.models.vision import _ACTIVATIONS, _COLUMNS, _ROWS, Dense

QUERY_CHUNK = 1024  # queries per attention chunk: scores [heads, 1024, patches] at most


@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    window_size: int  # pixels
    full_attention_layers: tuple[int, ...]
    num_channels: int
    hidden_act: str
    text_hidden_size: int
    image_token_id: int
    min_pixels: int
    max_pixels: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # Qwen2-VL's tower: LayerNorms and a plain MLP (fc1, fc2), every layer over the whole
    # image; Qwen2.5-VL's: RMSNorms, a gated MLP, windows.
    layer_norm: bool = False
    gated_mlp: bool = True
    bidirectional = False  # the decoder's image tokens attend causally
    dynamic = True  # images of many sizes: a variable number of rows each

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], processor: dict[str, Any], overrides: dict | None = None
    ) -> QwenVisionConfig:
        """From `config.json` and the image processor's `preprocessor_config.json` (its pixel
        bounds decide the most tokens an image takes), with `overrides` over the latter
        (`--mm-processor-kwargs`), as the processor reads them: `min_pixels` and `max_pixels`,
        else `size`'s shortest and longest edge."""
        vision, text = config["vision_config"], config.get("text_config") or config

        def bound(key: str, edge: str, default: int) -> int:
            for source in (overrides or {}, processor):
                value = source.get(key) or (source.get("size") or {}).get(edge)
                if value:
                    return int(value)
            return default

        min_pixels = bound("min_pixels", "shortest_edge", 56 * 56)
        max_pixels = bound("max_pixels", "longest_edge", 28 * 28 * 1280)
        rope = vision.get("rope_parameters") or {}
        image_token = config.get("image_token_id", 151655)
        common = dict(
            architecture=config["architectures"][0],
            num_layers=vision["depth"],
            num_heads=vision.get("num_heads", 16),
            patch_size=vision.get("patch_size", 14),
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            merge_size=vision.get("spatial_merge_size", 2),
            num_channels=vision.get("in_channels", vision.get("in_chans", 3)),
            image_token_id=int(image_token),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )
        if config.get("model_type") == "qwen2_vl":
            # Its vision_config's hidden_size is the merger's output (the decoder's width).
            width = vision.get("embed_dim", 1280)
            return cls(
                **common,
                hidden_size=width,
                intermediate_size=width * vision.get("mlp_ratio", 4),
                window_size=0,
                full_attention_layers=tuple(range(vision["depth"])),
                hidden_act=vision.get("hidden_act", "quick_gelu"),
                text_hidden_size=vision.get("hidden_size") or text["hidden_size"],
                layer_norm=True,
                gated_mlp=False,
            )
        return cls(
            **common,
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            window_size=vision.get("window_size", 112),
            full_attention_layers=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
            hidden_act=vision.get("hidden_act", "silu"),
            text_hidden_size=vision.get("out_hidden_size") or text["hidden_size"],
        )

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def unit(self) -> int:
        """Patches per token (a merge unit)."""
        return self.merge_size**2

    @property
    def max_tokens_per_image(self) -> int:
        return self.max_pixels // (self.patch_size * self.merge_size) ** 2

    @property
    def block_tokens(self) -> int:
        """The encoder cache's allocation unit, in rows."""
        return 16

    @property
    def window_units(self) -> int:
        """A window's side, in tokens (merge units); a tower without windows: one huge."""
        if not self.window_size:
            return 1 << 20
        return self.window_size // self.merge_size // self.patch_size

    def tokens_of(self, shape) -> int | None:
        """The tokens of an image whose pixels have this shape, or None if the model takes no
        such array: [t, h, w, merge^2 * patch_dim], t x h x w tokens."""
        shape = list(shape)
        if len(shape) != 4 or shape[3] != self.unit * self.patch_dim or min(shape[:3]) < 1:
            return None
        return shape[0] * shape[1] * shape[2]

    def embeds_tokens(self, shape) -> int | None:
        """The tokens of an image given as embeddings of this shape ([t, h, w, width], its
        tokens' grid), or None if the model takes no such array."""
        shape = list(shape)
        if len(shape) != 4 or shape[3] != self.text_hidden_size or min(shape[:3]) < 1:
            return None
        return shape[0] * shape[1] * shape[2]

    @property
    def pixel_shape_text(self) -> str:
        return f"[t, h, w, {self.unit * self.patch_dim}]"

    def encoder_buckets(self, num_blocks: int, budget: int) -> list[int]:
        """Patches per launch, compiled at warmup: powers of two from 64 up to the first that
        holds the patches of `budget` tokens (the most a step encodes)."""
        top = max(6, math.ceil(math.log2(budget * self.unit)))
        return [1 << i for i in range(6, top + 1)]

    def launch_size(self, shape) -> int:
        """An image's share of a launch's bucket: its patches."""
        return int(np.prod(shape[:3])) * self.unit

    def pack(self, images: list, bucket: int, drop: int) -> tuple[np.ndarray, ...]:
        """The encoder's (rows, *inputs) for `images` (module function `pack`)."""
        return pack(self, images, bucket, drop).args()

    def split_pixels(self, processed) -> list[np.ndarray]:
        """Each image's pixels from its HF processor's output: `pixel_values` [patches of all
        images, patch_dim], in merge units, and `image_grid_thw` [images, 3] in patches."""
        flat = np.asarray(processed["pixel_values"], np.float32)
        out, at = [], 0
        for t, h, w in np.asarray(processed["image_grid_thw"]).tolist():
            m = self.merge_size
            n = t * h * w
            out.append(flat[at : at + n].reshape(t, h // m, w // m, self.unit * self.patch_dim))
            at += n
        return out


@dataclasses.dataclass
class PatchBatch:
    """A step's images as one padded sequence of patches, in window order (`pack`)."""

    patches: np.ndarray  # f32[N, patch_dim]
    positions: np.ndarray  # i32[N, 2]: each patch's (row, column) in its frame
    windows: np.ndarray  # i32[N]: the window each patch attends within (-1: padding)
    frames: np.ndarray  # i32[N]: the frame each patch attends within in full layers
    rows: np.ndarray  # i32[N / merge^2]: each token's row of the encoder cache (past it: none)

    def args(self) -> tuple[np.ndarray, ...]:
        return (self.rows, self.patches, self.positions, self.windows, self.frames)


def pack(
    c: QwenVisionConfig, images: list[tuple[np.ndarray, np.ndarray]], num_patches: int, drop: int
) -> PatchBatch:
    """`images`: (pixels [t, h, w, merge^2 * patch_dim], the encoder cache row of each of its
    t*h*w tokens in raster order) -> their patches in window order, padded to `num_patches`;
    padding writes to row `drop` (out of the cache: dropped)."""
    u, k = c.unit, c.patch_dim
    batch = PatchBatch(
        patches=np.zeros((num_patches, k), np.float32),
        positions=np.zeros((num_patches, 2), np.int32),
        windows=np.full(num_patches, -1, np.int32),
        frames=np.full(num_patches, -1, np.int32),
        rows=np.full(num_patches // u, drop, np.int32),
    )
    m, vws = c.merge_size, c.window_units
    at = window_id = frame_id = 0
    for pixels, rows in images:
        t, h, w = pixels.shape[:3]
        units = pixels.reshape(t, h, w, u, k)
        # Windows of vws x vws tokens, row-major over the frame, tokens row-major inside.
        gh, gw = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        order = np.lexsort((gw.ravel(), gh.ravel(), gw.ravel() // vws, gh.ravel() // vws))
        window_of = ((gh // vws) * (-(-w // vws)) + gw // vws).ravel()[order]
        _, window_of = np.unique(window_of, return_inverse=True)
        sub = np.arange(u)
        for f in range(t):
            n = h * w
            span = slice(at * u, (at + n) * u)
            batch.patches[span] = units[f].reshape(n, u, k)[order].reshape(n * u, k)
            batch.positions[span, 0] = (gh.ravel()[order, None] * m + sub // m).ravel()
            batch.positions[span, 1] = (gw.ravel()[order, None] * m + sub % m).ravel()
            batch.windows[span] = np.repeat(window_id + window_of, u)
            batch.frames[span] = frame_id
            batch.rows[at : at + n] = rows[f * n : (f + 1) * n][order]
            at += n
            window_id += int(window_of.max()) + 1
            frame_id += 1
    return batch


class VisionBlock(nnx.Module):
    def __init__(self, c: QwenVisionConfig, *, dtype, rngs):
        d, f = c.hidden_size, c.intermediate_size
        self.norm1, self.norm2 = (_norm(c, d, dtype) for _ in range(2))
        self.qkv = Dense(d, 3 * d, _COLUMNS, dtype=dtype, rngs=rngs)
        self.proj = Dense(d, d, _ROWS, dtype=dtype, rngs=rngs)
        if c.gated_mlp:
            self.gate_proj = Dense(d, f, _COLUMNS, dtype=dtype, rngs=rngs)
            self.up_proj = Dense(d, f, _COLUMNS, dtype=dtype, rngs=rngs)
            self.down_proj = Dense(f, d, _ROWS, dtype=dtype, rngs=rngs)
        else:
            self.fc1 = Dense(d, f, _COLUMNS, dtype=dtype, rngs=rngs)
            self.fc2 = Dense(f, d, _ROWS, dtype=dtype, rngs=rngs)
        self.gated = c.gated_mlp
        self.num_heads = c.num_heads
        self.act = _ACTIVATIONS[c.hidden_act]

    def __call__(self, x, cos, sin, segments, band):  # x [N, D]
        n, d = x.shape
        heads = self.num_heads
        q, k, v = jnp.moveaxis(self.qkv(self.norm1(x)).reshape(n, 3, heads, d // heads), 1, 0)
        q, k = (_rotate(y, cos, sin) for y in (q, k))
        x = x + self.proj(_segment_attention(q, k, v, segments, band).reshape(n, d))
        y = self.norm2(x)
        if self.gated:
            return x + self.down_proj(self.act(self.gate_proj(y)) * self.up_proj(y))
        return x + self.fc2(self.act(self.fc1(y)))


def _norm(c: QwenVisionConfig, dim: int, dtype):
    return (
        LayerNorm(dim, c.norm_eps, dtype=dtype)
        if c.layer_norm
        else RMSNorm(dim, c.norm_eps, dtype=dtype)
    )


def _rotate(x, cos, sin):
    """Rotary embedding ("rotate half"), in float32 as transformers computes it."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)


def _segment_attention(q, k, v, segments, band: int | None = None):
    """Softmax attention of each patch over the patches of its segment. q, k, v [N, heads,
    head_dim]; segments i32[N], each segment contiguous. By chunks of queries, so the scores
    take at most about 512 MiB; with `band` (segments of at most that many patches: windows),
    a chunk's keys are only those within `band` of it."""
    n, heads, hd = q.shape
    scale = hd**-0.5
    if band is None:
        size = max(16, min(QUERY_CHUNK, 2**27 // (heads * n)))
    else:
        size = QUERY_CHUNK
    size = min(size, n)

    def attend(qc, sc, kc, vc, skc):
        scores = jnp.einsum("qnh,knh->nqk", qc, kc, preferred_element_type=jnp.float32) * scale
        scores = jnp.where((sc[:, None] == skc[None, :])[None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(vc.dtype)
        return jnp.einsum("nqk,knh->qnh", probs, vc)

    if size == n and band is None:
        return attend(q, segments, k, v, segments)
    segments_k = segments
    if band is not None:  # keys padded by `band` on each side, in a segment no query has
        pad = ((band, band), (0, 0), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
        segments_k = jnp.pad(segments, band, constant_values=-2)

    def chunk(i):
        start = i * size
        qc = jax.lax.dynamic_slice_in_dim(q, start, size)
        sc = jax.lax.dynamic_slice_in_dim(segments, start, size)
        if band is None:
            return attend(qc, sc, k, v, segments_k)
        width = size + 2 * band  # keys [start - band, start + size + band) of the unpadded
        kc, vc, skc = (jax.lax.dynamic_slice_in_dim(a, start, width) for a in (k, v, segments_k))
        return attend(qc, sc, kc, vc, skc)

    return jax.lax.map(chunk, jnp.arange(n // size)).reshape(q.shape)


class PatchMerger(nnx.Module):
    """Each merge unit's patches, RMS-normed, concatenated and through a two-layer MLP."""

    def __init__(self, c: QwenVisionConfig, *, dtype, rngs):
        d, wide = c.hidden_size, c.hidden_size * c.unit
        self.ln_q = _norm(c, d, dtype)
        self.mlp_0 = Dense(wide, wide, _COLUMNS, dtype=dtype, rngs=rngs)
        self.mlp_2 = Dense(wide, c.text_hidden_size, _ROWS, dtype=dtype, rngs=rngs)
        self.wide = wide

    def __call__(self, x):
        y = self.ln_q(x).reshape(-1, self.wide)
        return self.mlp_2(_ACTIVATIONS["gelu"](self.mlp_0(y)))


class QwenVisionEncoder(nnx.Module):
    """A step's patches (`PatchBatch`, window order) -> one row per merge unit, in the
    decoder's width."""

    def __init__(self, config: QwenVisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.config = config
        c = config
        self.patch_embed = param(rngs, (c.patch_dim, c.hidden_size), (None, "embed"), dtype)
        self.blocks = nnx.List(VisionBlock(c, dtype=dtype, rngs=rngs) for _ in range(c.num_layers))
        self.merger = PatchMerger(c, dtype=dtype, rngs=rngs)
        quarter = c.hidden_size // c.num_heads // 2
        self.inv_freq = tuple(
            float(f) for f in 1.0 / c.rope_theta ** (np.arange(0, quarter, 2) / quarter)
        )

    def __call__(self, patches, positions, windows, frames):
        c = self.config
        weight = self.patch_embed.get_value()
        x = jnp.einsum("nk,kd->nd", patches.astype(weight.dtype), weight)
        freqs = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(self.inv_freq)
        freqs = freqs.reshape(len(positions), -1)  # (row freqs, column freqs)
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        cos, sin = jnp.cos(emb), jnp.sin(emb)
        # Padding patches (segment -1 in both) attend among themselves: never NaN (a run of
        # padding may be longer than `band`, but a query always sees its own key).
        band = c.window_units**2 * c.unit  # a window's patches at most
        for i, block in enumerate(self.blocks):
            if i in c.full_attention_layers:
                x = block(x, cos, sin, frames, None)
            else:
                x = block(x, cos, sin, windows, band)
        return self.merger(x)

"""A prompt and its images -> token ids with each image's placeholder tokens, and the images'
pixels (`MultiModalItem`s), through the model's own Hugging Face processor (its PIL backend:
no torch) loaded from the checkpoint directory.

A text prompt goes through the processor whole, so each family's placeholder layout is its
own (LLaVA: the image token repeated once per patch). Token ids may hold each image's
placeholder once (expanded here) or already expanded. The engine core checks the result again
(`check_mm_items`), as it checks every prompt it is handed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxllm.errors import InputError
from jaxllm.multimodal.media import load_image
from jaxllm.worker import MultiModalItem


class LoadedImages(list):
    """`ImageProcessor.load`'s images, with the parameter each came from (for errors)."""

    params: list[str]


class ImageProcessor:
    def __init__(
        self,
        path: Path,
        vision,
        *,
        limit: int,
        allowed_local_media_path: str | None = None,
        allowed_media_domains: Sequence[str] | None = None,
        processor_kwargs: dict | None = None,
        enable_mm_embeds: bool = False,
    ):
        """`vision`: the model's vision side (`jaxllm.loaders.vision.vision_config`, read with
        the same `processor_kwargs`, which override the HF processor's settings)."""
        from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
        from transformers.utils import logging as hf_logging

        kwargs = processor_kwargs or {}
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # "falling back to the PIL backend": as meant
        try:
            try:
                self.hf = AutoProcessor.from_pretrained(path, **kwargs)
                self.image_processor, self.tokenizer = self.hf.image_processor, self.hf.tokenizer
            except (ImportError, ValueError, TypeError):
                # A processor that needs torchvision (Qwen2.5-VL's, for its video side): its
                # image processor and tokenizer, the placeholders expanded here.
                self.hf = None
                self.image_processor = AutoImageProcessor.from_pretrained(path, **kwargs)
                self.tokenizer = AutoTokenizer.from_pretrained(path)
        finally:
            hf_logging.set_verbosity(verbosity)
        self.vision = vision  # the model's `VisionConfig` or `QwenVisionConfig`
        self.limit = limit
        self.enable_mm_embeds = enable_mm_embeds
        self.allowed_local_media_path = allowed_local_media_path
        self.allowed_media_domains = allowed_media_domains

    @classmethod
    def for_engine(cls, model_path: Path, ready, config) -> ImageProcessor | None:
        """The processor of an engine whose core takes images (`Ready.image_limit`), else
        None. `config`: the engine's (its multimodal section)."""
        if not ready.image_limit:
            return None
        from jaxllm.loaders.vision import vision_config

        mm = config.multimodal
        return cls(
            model_path,
            vision_config(model_path, mm.mm_processor_kwargs),
            limit=ready.image_limit,
            allowed_local_media_path=mm.allowed_local_media_path,
            allowed_media_domains=mm.allowed_media_domains,
            processor_kwargs=mm.mm_processor_kwargs,
            enable_mm_embeds=mm.enable_mm_embeds,
        )

    def load(self, sources: Sequence[Any], param: str) -> list:
        """PIL images from their sources (URLs, PIL images, arrays; or (source, parameter)
        pairs, each named in its own errors), checked."""
        self._check_count(len(sources), param)
        pairs = [s if isinstance(s, tuple) else (s, param) for s in sources]
        loaded = LoadedImages(
            load_image(
                s,
                at,
                allowed_local_media_path=self.allowed_local_media_path,
                allowed_media_domains=self.allowed_media_domains,
            )
            for s, at in pairs
        )
        loaded.params = [at for _, at in pairs]
        return loaded

    def _check_count(self, n: int, param: str) -> None:
        if n > self.limit:
            raise InputError(
                f"{param}: {n} images, more than the {self.limit} a prompt may carry "
                "(--limit-mm-per-prompt)",
                param,
            )

    def process(
        self,
        prompt: str | list[int],
        images: list,
        *,
        add_special_tokens: bool = True,
        param: str = "multi_modal_data",
    ) -> tuple[list[int], list[MultiModalItem]]:
        """(token ids, the images as items) of a prompt (text, or token ids) and its loaded
        images, in prompt order."""
        try:
            if isinstance(prompt, str) and self.hf is not None:  # the images with the text
                out = self._with_text(prompt, images, add_special_tokens)
                ids = out["input_ids"][0].tolist()
                pixels = self.vision.split_pixels(out)
            else:
                out = self.image_processor(images=images, return_tensors="np")
                pixels = self.vision.split_pixels(out)
                lengths = [self.vision.tokens_of(p.shape) for p in pixels]
                ids = self._expanded(prompt, lengths, add_special_tokens)
        except InputError:
            raise
        except (ValueError, TypeError, OSError) as e:
            at = self._refused(images, param)
            raise InputError(f"{at}: the model's processor refused the image: {e}", at) from None
        return ids, self.items(ids, pixels, param)

    def _with_text(self, prompt: str, images: list, add_special_tokens: bool) -> dict:
        """The model's HF processor's output for a text prompt and its images."""
        return self.hf(
            text=[prompt], images=images, return_tensors="np", add_special_tokens=add_special_tokens
        )

    def _refused(self, images: list, param: str) -> str:
        """The parameter of the first image the image processor refuses alone (`load`
        names each), else `param`."""
        for image, at in zip(images, getattr(images, "params", ()), strict=False):
            try:
                self.image_processor(images=[image], return_tensors="np")
            except (ValueError, TypeError, OSError):
                return at
        return param

    def process_embeds(
        self,
        prompt: str | list[int],
        data: dict,
        *,
        add_special_tokens: bool = True,
        param: str = "multi_modal_data",
    ) -> tuple[list[int], list[MultiModalItem]]:
        """(token ids, the images as items) of a prompt whose images come as embeddings, as
        vLLM takes them: {"image_embeds": [images, tokens, width] or [tokens, width], and for
        Qwen2-VL/2.5-VL "image_grid_thw": [images, 3] (patches), the embeddings of all images
        concatenated [tokens, width]}. Each image token in the prompt is expanded to its
        image's tokens (or the prompt holds them expanded already)."""
        v, at = self.vision, f"{param}.image.image_embeds"
        if not self.enable_mm_embeds:
            raise InputError(
                f"{at}: image embeddings are not enabled for this engine (enable_mm_embeds)", at
            )
        unknown = sorted(set(data) - {"image_embeds", "image_grid_thw"})
        if unknown:
            raise InputError(f"{param}.image: unknown key(s) {', '.join(unknown)}", param)
        try:
            embeds = np.asarray(data["image_embeds"], np.float32)
        except (TypeError, ValueError) as e:
            raise InputError(f"{at}: not an array of numbers: {e}", at) from None
        width = v.text_hidden_size
        if embeds.ndim not in (2, 3) or embeds.shape[-1] != width or not embeds.size:
            raise InputError(
                f"{at}: shape {list(embeds.shape)}; the model takes [images, tokens, {width}] "
                f"or [tokens, {width}]",
                at,
            )
        if not np.isfinite(embeds).all():
            raise InputError(f"{at}: not finite", at)
        if v.dynamic:
            arrays = self._by_grid(embeds.reshape(-1, width), data.get("image_grid_thw"), param)
        else:
            arrays = list(embeds if embeds.ndim == 3 else embeds[None])
        self._check_count(len(arrays), param)
        lengths = [v.embeds_tokens(a.shape) for a in arrays]
        for array, n in zip(arrays, lengths, strict=True):
            if n is None or n > v.max_tokens_per_image:
                raise InputError(
                    f"{at}: an image of {len(array.reshape(-1, width))} rows; the model makes "
                    + ("at most " if v.dynamic else "")
                    + f"{v.max_tokens_per_image} of an image",
                    at,
                )
        if isinstance(prompt, str) and self.hf is not None and not v.dynamic:
            # The processor lays the placeholders out its own way (Gemma's begin and end
            # tokens): given blank images (all the same size to it), the same ids.
            from PIL import Image

            blank = [Image.new("RGB", (8, 8))] * len(arrays)
            try:
                ids = self._with_text(prompt, blank, add_special_tokens)["input_ids"][0].tolist()
            except (ValueError, TypeError) as e:
                raise InputError(f"{param}: {e}", param) from None
        else:
            ids = self._expanded(prompt, lengths, add_special_tokens)
        return ids, self.items(ids, arrays, param, lengths=lengths, embeds=True)

    def _by_grid(self, rows: np.ndarray, grids, param: str) -> list[np.ndarray]:
        """Qwen's embeddings of concatenated images split by their patch grids, each
        [frames, rows, columns, width] in tokens."""
        at = f"{param}.image.image_grid_thw"
        try:
            grids = np.asarray(grids, np.int64).reshape(-1, 3)
        except (TypeError, ValueError):
            raise InputError(
                f"{at}: this model's image_embeds need their [t, h, w] grids", at
            ) from None
        m = self.vision.merge_size
        if (grids < 1).any() or (grids[:, 1:] % m).any():
            raise InputError(f"{at}: each grid [t, h, w] in patches, h and w multiples of {m}", at)
        tokens = grids[:, 0] * (grids[:, 1] // m) * (grids[:, 2] // m)
        if int(tokens.sum()) != len(rows):
            raise InputError(
                f"{at}: the grids make {int(tokens.sum())} tokens; image_embeds has {len(rows)}",
                at,
            )
        starts = np.concatenate([[0], np.cumsum(tokens)])
        return [
            rows[a:b].reshape(t, h // m, w // m, -1)
            for (t, h, w), a, b in zip(grids.tolist(), starts[:-1], starts[1:], strict=True)
        ]

    def _expanded(
        self, prompt: str | list[int], lengths: list[int | None], add_special_tokens: bool
    ) -> list[int]:
        """The prompt's token ids (a text tokenized) with each lone image token repeated as
        its image's placeholders (the images' token counts in order; a token-id prompt may
        also hold them expanded)."""
        if isinstance(prompt, str):
            prompt = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        ids = list(prompt)
        out: list[int] = []
        t = self.vision.image_token_id
        lengths = iter([n or 0 for n in lengths])
        for i, token in enumerate(ids):
            lone = (
                token == t
                and (i == 0 or ids[i - 1] != t)
                and (i + 1 == len(ids) or ids[i + 1] != t)
            )
            out.extend([t] * next(lengths, 1) if lone else [token])
        return out

    def items(
        self,
        ids: list[int],
        pixels: list[np.ndarray],
        param: str,
        *,
        lengths: list[int | None] | None = None,
        embeds: bool = False,
    ) -> list[MultiModalItem]:
        """The images' items at the placeholders of `ids`, in order: each image takes as many
        as it makes tokens (`lengths`, default from the pixels' shapes; adjacent images share
        a run of placeholders). `embeds`: the arrays are the images' embeddings."""
        t = self.vision.image_token_id
        marks = np.flatnonzero(np.asarray(ids) == t)
        if lengths is None:
            lengths = [self.vision.tokens_of(p.shape) for p in pixels]
        if sum(n or 0 for n in lengths) != len(marks) or None in lengths:
            raise InputError(
                f"{param}: the prompt has {len(marks)} image placeholder tokens; its "
                f"{len(pixels)} image(s) take {sum(n or 0 for n in lengths)}",
                param,
            )
        most = self.vision.max_tokens_per_image
        if max(lengths, default=0) > most:  # a very thin image, its short side rounded up
            raise InputError(
                f"{param}: an image of {max(lengths)} tokens; the model takes at most {most} "
                "(its aspect ratio is too extreme for its pixel bound)",
                param,
            )
        items, k = [], 0
        for x, n in zip(pixels, lengths, strict=True):
            offset = int(marks[k])
            if ids[offset : offset + n] != [t] * n:
                raise InputError(
                    f"{param}: the prompt's image placeholders do not make whole images "
                    f"(an image of {n} tokens at {offset})",
                    param,
                )
            items.append(MultiModalItem.of(x, offset, n, embeds=embeds))
            k += n
        return items


def check_mm_items(
    items: Sequence[MultiModalItem],
    prompt_token_ids: Sequence[int],
    vision,
    limit: int | None,
    *,
    embeds: bool = False,
) -> None:
    """Raises a ValueError unless a request's images fit its prompt and the model: each at a
    run of its placeholder tokens of the image's length, pixels of the model's shape, every
    placeholder covered, no more than `limit`. `vision`: the model's `VisionConfig`, or None
    for a model without images."""
    if vision is None:
        if items:
            raise ValueError("multi_modal_data: this model takes no images")
        return
    if limit is not None and len(items) > limit:
        raise ValueError(f"multi_modal_data: {len(items)} images, more than {limit}")
    t = vision.image_token_id
    ids = np.asarray(prompt_token_ids)
    covered = 0
    end = 0
    for item in sorted(items, key=lambda x: x.offset):
        if item.embeds and not embeds:
            raise ValueError(
                "multi_modal_data: image embeddings are not enabled (enable_mm_embeds)"
            )
        shape = item.values.shape
        p = vision.embeds_tokens(shape) if item.embeds else vision.tokens_of(shape)
        if p is None or len(item.values.data) != 4 * int(np.prod(shape)):
            what = "embeddings" if item.embeds else "pixels"
            raise ValueError(
                f"multi_modal_data: {what} of shape {shape} do not fit the model "
                f"({vision.pixel_shape_text} pixels, {vision.text_hidden_size} wide embeddings)"
            )
        if p > vision.max_tokens_per_image:
            raise ValueError(
                f"multi_modal_data: an image of {p} tokens; the model takes at most "
                f"{vision.max_tokens_per_image}"
            )
        if item.length != p or item.offset < end or item.offset + p > len(ids):
            raise ValueError(f"multi_modal_data: an image at {item.offset} does not fit the prompt")
        if not (ids[item.offset : item.offset + p] == t).all():
            raise ValueError(f"multi_modal_data: the image at {item.offset} is not on placeholders")
        end = item.offset + p
        covered += p
    if covered != int((ids == t).sum()):
        raise ValueError("multi_modal_data: the prompt has image placeholders without an image")

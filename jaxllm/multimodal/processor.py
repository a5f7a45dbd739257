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

from jaxllm.engine.input_processor import InputError
from jaxllm.multimodal.media import load_image
from jaxllm.worker import MultiModalItem


class ImageProcessor:
    def __init__(
        self,
        path: Path,
        *,
        image_token_id: int,
        tokens_per_image: int,
        limit: int,
        allowed_local_media_path: str | None = None,
        allowed_media_domains: Sequence[str] | None = None,
    ):
        from transformers import AutoProcessor
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # "falling back to the PIL backend": as meant
        try:
            self.hf = AutoProcessor.from_pretrained(path)
        finally:
            hf_logging.set_verbosity(verbosity)
        self.image_token_id = image_token_id
        self.tokens_per_image = tokens_per_image
        self.limit = limit
        self.allowed_local_media_path = allowed_local_media_path
        self.allowed_media_domains = allowed_media_domains

    @classmethod
    def for_engine(cls, model_path: Path, ready, config) -> ImageProcessor | None:
        """The processor of an engine whose core takes images (`Ready.image_limit`), else
        None. `config`: the engine's (its multimodal section)."""
        if not ready.image_limit:
            return None
        return cls(
            model_path,
            image_token_id=ready.image_token_id,
            tokens_per_image=ready.image_tokens,
            limit=ready.image_limit,
            allowed_local_media_path=config.multimodal.allowed_local_media_path,
            allowed_media_domains=config.multimodal.allowed_media_domains,
        )

    def load(self, sources: Sequence[Any], param: str) -> list:
        """PIL images from their sources (URLs, PIL images, arrays; or (source, parameter)
        pairs, each named in its own errors), checked."""
        if len(sources) > self.limit:
            raise InputError(
                f"{param}: {len(sources)} images, more than the {self.limit} a prompt may "
                "carry (--limit-mm-per-prompt)",
                param,
            )
        pairs = [s if isinstance(s, tuple) else (s, param) for s in sources]
        return [
            load_image(
                s,
                at,
                allowed_local_media_path=self.allowed_local_media_path,
                allowed_media_domains=self.allowed_media_domains,
            )
            for s, at in pairs
        ]

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
            if isinstance(prompt, str):  # the images are processed with the text, once
                out = self.hf(
                    text=[prompt],
                    images=images,
                    return_tensors="np",
                    add_special_tokens=add_special_tokens,
                )
                ids = out["input_ids"][0].tolist()
            else:
                out = self.hf.image_processor(images=images, return_tensors="np")
                ids = self._expanded(prompt)
            pixels = out["pixel_values"]
        except InputError:
            raise
        except (ValueError, TypeError, OSError) as e:
            raise InputError(
                f"{param}: the model's processor refused the images: {e}", param
            ) from None
        return ids, self.items(ids, np.asarray(pixels, np.float32), param)

    def _expanded(self, ids: list[int]) -> list[int]:
        """Token ids with each lone image token repeated as the image's placeholders."""
        out: list[int] = []
        t, p = self.image_token_id, self.tokens_per_image
        for i, token in enumerate(ids):
            lone = (
                token == t
                and (i == 0 or ids[i - 1] != t)
                and (i + 1 == len(ids) or ids[i + 1] != t)
            )
            out.extend([t] * p if lone else [token])
        return out

    def items(self, ids: list[int], pixels: np.ndarray, param: str) -> list[MultiModalItem]:
        """The images' items at their placeholder runs of `ids` (a run of k images' worth of
        placeholders holds k images)."""
        t, p = self.image_token_id, self.tokens_per_image
        marks = np.flatnonzero(np.asarray(ids) == t)
        offsets = [int(m) for m in marks[::p]] if len(marks) % p == 0 else None
        if offsets is None or any(ids[o : o + p] != [t] * p for o in offsets):
            raise InputError(
                f"{param}: the prompt's image placeholders do not make whole images "
                f"({len(marks)} placeholder tokens; an image takes {p})",
                param,
            )
        if len(offsets) != len(pixels):
            raise InputError(
                f"{param}: the prompt has placeholders for {len(offsets)} image(s) but "
                f"{len(pixels)} were given",
                param,
            )
        return [MultiModalItem.of(x, o, p) for x, o in zip(pixels, offsets, strict=True)]


def check_mm_items(
    items: Sequence[MultiModalItem], prompt_token_ids: Sequence[int], vision, limit: int | None
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
    t, p = vision.image_token_id, vision.tokens_per_image
    ids = np.asarray(prompt_token_ids)
    covered = 0
    end = 0
    for item in sorted(items, key=lambda x: x.offset):
        if item.length != p or item.offset < end or item.offset + p > len(ids):
            raise ValueError(f"multi_modal_data: an image at {item.offset} does not fit the prompt")
        if not (ids[item.offset : item.offset + p] == t).all():
            raise ValueError(f"multi_modal_data: the image at {item.offset} is not on placeholders")
        if list(item.pixels.shape) != list(vision.pixel_shape) or len(item.pixels.data) != 4 * int(
            np.prod(vision.pixel_shape)
        ):
            raise ValueError(
                f"multi_modal_data: pixels of shape {item.pixels.shape}; the model takes "
                f"{list(vision.pixel_shape)}"
            )
        end = item.offset + p
        covered += p
    if covered != int((ids == t).sum()):
        raise ValueError("multi_modal_data: the prompt has image placeholders without an image")

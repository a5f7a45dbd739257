"""A chat's image parts, for the chat template: OpenAI's `image_url` parts (and vLLM's
`image_pil` offline) become `{"type": "image"}`, where an image-text model's template writes
its image placeholder; their sources come out in order, to load and process with the
rendered prompt."""

from __future__ import annotations

from typing import Any

from jaxllm.errors import InputError

IMAGE_PART_TYPES = ("image_url", "image_pil")


def split_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """(the messages with image parts as `{"type": "image"}`, the images' sources in order).
    Messages without image parts come back as they are."""
    sources: list[Any] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list) or not any(
            isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in content
        ):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in IMAGE_PART_TYPES:
                parts.append(part)
                continue
            param = f"messages.{i}.content.{j}.{kind}"
            source = part.get(kind)
            if kind == "image_url":
                source = source.get("url") if isinstance(source, dict) else source
                if not isinstance(source, str):
                    raise InputError(f"{param}: an image_url part needs a string 'url'", param)
            sources.append((source, param))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, sources

"""Images from where requests name them, decoded and checked: a `data:` URL (base64 PNG,
JPEG, WebP, GIF or BMP), a `file://` URL or path under the allowed local media directory, an
`http(s)` URL on an allowed host (fetched within a time and size limit, no redirects), a PIL
image or an array. Every refusal is an `InputError` naming the parameter."""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np

from jaxllm.errors import InputError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # an image's encoded bytes (OpenAI's limit)
MAX_IMAGE_PIXELS = 40_000_000  # width x height of a decoded image (a decompression bomb)
FETCH_TIMEOUT_S = 5.0  # an http(s) image's whole download (vLLM's VLLM_IMAGE_FETCH_TIMEOUT)


def load_image(
    source: Any,
    param: str,
    *,
    allowed_local_media_path: str | None = None,
    allowed_media_domains: Sequence[str] | None = None,
):
    """A PIL image (RGB) from an image source."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return _checked(source, param)
    if isinstance(source, np.ndarray):
        return _from_array(source, param)
    if not isinstance(source, str):
        raise InputError(
            f"{param}: an image must be a URL, a PIL image or an array, got "
            f"{type(source).__name__}",
            param,
        )
    if source.startswith("data:"):
        return _decode(_data_url_bytes(source, param), param)
    scheme = urlparse(source).scheme.lower()
    if scheme in ("http", "https"):
        return _decode(_fetch(source, param, allowed_media_domains), param)
    if scheme in ("file", ""):
        return _decode(_local_bytes(source, param, allowed_local_media_path), param)
    raise InputError(f"{param}: URL scheme {scheme!r} is not supported for images", param)


def _data_url_bytes(url: str, param: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise InputError(f"{param}: a data: URL must be data:image/<format>;base64,<data>", param)
    mime = header[len("data:") : -len(";base64")]
    if not mime.startswith("image/"):
        raise InputError(f"{param}: data: URL media type {mime!r} is not an image", param)
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise InputError(f"{param}: the image is larger than {MAX_IMAGE_BYTES} bytes", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{param}: the data: URL is not valid base64", param) from None


def _fetch(url: str, param: str, domains: Sequence[str] | None) -> bytes:
    """An http(s) URL's bytes: its host allowed, status 200 without a redirect, at most
    MAX_IMAGE_BYTES, all within FETCH_TIMEOUT_S."""
    import httpx

    host = (urlparse(url).hostname or "").lower()
    if not domains:
        raise InputError(
            f"{param}: http(s) image URLs are not fetched by this server (--allowed-media-domains "
            "names the hosts that may be); send the image as a data: URL (base64)",
            param,
        )
    if not any(host == d.lower() or host.endswith("." + d.lower()) for d in domains):
        raise InputError(f"{param}: host {host[:100]!r} is not in --allowed-media-domains", param)
    deadline = time.monotonic() + FETCH_TIMEOUT_S
    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=False) as r:
            if r.status_code != 200:
                raise InputError(f"{param}: fetching the image gave HTTP {r.status_code}", param)
            data = bytearray()
            for chunk in r.iter_bytes():
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    raise InputError(
                        f"{param}: the image is larger than {MAX_IMAGE_BYTES} bytes", param
                    )
                if time.monotonic() > deadline:
                    raise InputError(
                        f"{param}: fetching the image took longer than {FETCH_TIMEOUT_S} s", param
                    )
    except httpx.TimeoutException:
        raise InputError(
            f"{param}: fetching the image took longer than {FETCH_TIMEOUT_S} s", param
        ) from None
    except httpx.HTTPError as e:
        raise InputError(
            f"{param}: the image could not be fetched ({type(e).__name__})", param
        ) from None
    return bytes(data)


def _local_bytes(url: str, param: str, allowed: str | None) -> bytes:
    if allowed is None:
        raise InputError(
            f"{param}: local image files are not allowed (the server's "
            "--allowed-local-media-path names the directory they may come from)",
            param,
        )
    path = Path(unquote(urlparse(url).path) if url.startswith("file:") else url)
    root = Path(os.path.realpath(allowed))
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(root):
        raise InputError(
            f"{param}: {str(path)[:200]!r} is outside --allowed-local-media-path", param
        )
    if not real.is_file():
        raise InputError(f"{param}: no image file {str(path)[:200]!r}", param)
    if real.stat().st_size > MAX_IMAGE_BYTES:
        raise InputError(f"{param}: the image is larger than {MAX_IMAGE_BYTES} bytes", param)
    return real.read_bytes()


def _decode(data: bytes, param: str):
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise InputError(f"{param}: the image is larger than {MAX_IMAGE_BYTES} bytes", param)
    try:
        image = Image.open(io.BytesIO(data), formats=None)
        if image.format not in FORMATS:
            raise InputError(
                f"{param}: image format {image.format} is not supported ({', '.join(FORMATS)})",
                param,
            )
        _check_size(image, param)
        image.load()
    except InputError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise InputError(f"{param}: the image data is corrupt or not an image", param) from None
    return _checked(image, param)


def _check_size(image, param: str) -> None:
    w, h = image.size
    if w < 1 or h < 1:
        raise InputError(f"{param}: the image is empty ({w}x{h})", param)
    if w * h > MAX_IMAGE_PIXELS:
        raise InputError(
            f"{param}: the image is too large ({w}x{h} pixels; at most {MAX_IMAGE_PIXELS})", param
        )


def _checked(image, param: str):
    _check_size(image, param)
    return image if image.mode == "RGB" else image.convert("RGB")


def _from_array(array: np.ndarray, param: str):
    from PIL import Image

    if array.ndim != 3 or array.shape[-1] not in (1, 3, 4):
        raise InputError(
            f"{param}: an image array must be [height, width, channels] with 1, 3 or 4 "
            f"channels, got shape {array.shape}",
            param,
        )
    if array.dtype != np.uint8:
        raise InputError(f"{param}: an image array must be uint8, got {array.dtype}", param)
    if array.shape[-1] == 1:
        array = array[..., 0]
    return _checked(Image.fromarray(array), param)

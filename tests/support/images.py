"""Test images as OpenAI `image_url` content parts."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def image_uri(width: int, height: int, seed: int, fmt: str = "PNG") -> str:
    """A data URI of smooth gradients plus noise: realistic enough that resize filters matter."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), ((x + y) * 127 // max(width + height, 1))], -1)
    arr = np.clip(base + rng.integers(-40, 40, size=(height, width, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    mime = "image/jpeg" if fmt == "JPEG" else "image/png"
    return f"data:{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(uri: str) -> dict:
    return {"type": "image_url", "image_url": {"url": uri}}

"""Untrusted image bytes -> RGB uint8 pixels, with hard limits checked before anything is decoded.

The conversion to RGB copies what vLLM 0.32's media loader does (`vllm/multimodal/media/image.py`,
`ImageMediaIO.load_bytes`, and `vllm/multimodal/image.py`), because the engine's answer depends on the
exact pixels:

1. `Image.open` (header only), then vLLM's pixel limit;
2. `ImageOps.exif_transpose` — the EXIF orientation is applied, so a portrait phone photo stored
   landscape comes out portrait (and its width and height swap: the token count depends on it);
3. `load()` — for animated GIF/WebP/PNG that is the first frame;
4. mode conversion: RGB stays; RGBA is alpha-composited onto a white background; any other mode that
   carries transparency (LA, PA, or a `transparency` entry, e.g. a palette PNG/GIF with a transparent
   index) is converted to RGBA first and then composited the same way; everything else (L, P, CMYK,
   I;16, YCbCr, ...) is a plain `convert("RGB")`.

Only JPEG, PNG, WebP, GIF and BMP are accepted (vLLM allows more formats; a gateway has no reason to
parse TIFF or PSD from strangers).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

__all__ = ["ImageError", "ImageHeader", "ImageLimits", "decode_image", "decode_rgb", "read_header", "rgb_array"]

ACCEPTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")

# EXIF orientations 5..8 are transposes/rotations by 90 degrees: the displayed image swaps width and height.
_EXIF_ORIENTATION_TAG = 0x0112
_SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})


class ImageError(ValueError):
    """The bytes are not an acceptable image: not an image at all, truncated, or over a limit."""


@dataclass(frozen=True)
class ImageLimits:
    """What an image may weigh, encoded and decoded; both checked before any pixel is decoded."""

    max_bytes: int
    # Width × height from the header (decompression bombs: 50 MP decode to 150 MB of RGB).
    max_pixels: int


@dataclass(frozen=True)
class ImageHeader:
    """What the header says, with the EXIF orientation already applied to width and height."""

    format: str  # Pillow's format name: "JPEG", "PNG", ...
    mode: str  # Pillow's mode before conversion: "RGB", "P", "RGBA", "L", "CMYK", ...
    width: int
    height: int


def read_header(data: bytes, limits: ImageLimits) -> ImageHeader:
    """Width, height (as displayed), format and mode, without decoding pixels; enforces the limits."""
    with _opened(data, limits) as image:
        width, height = image.size
        if _exif_orientation(image) in _SWAPPING_ORIENTATIONS:
            width, height = height, width
        return ImageHeader(format=image.format or "", mode=image.mode, width=width, height=height)


def decode_rgb(data: bytes, limits: ImageLimits) -> np.ndarray:
    """Decode to an RGB uint8 array [H, W, 3] (C-contiguous, read-only), converting exactly as vLLM does."""
    return rgb_array(decode_image(data, limits))


def decode_image(data: bytes, limits: ImageLimits) -> Image.Image:
    """The same decode and conversion as `decode_rgb`, as a loaded PIL image in mode RGB.

    The model families' `process` accepts it directly: with pillow-simd the resize then runs on it as it
    is, skipping the copy out to numpy and back.
    """
    with _opened(data, limits) as image:
        try:
            rgb = _to_rgb(_exif_transposed(image))
            if rgb is image:
                # `image` is closed (its core released) when the context exits; hand out a new image object
                # over the same pixels instead of copying them.
                rgb = image._new(image.im) if hasattr(image, "_new") else image.copy()
            return rgb
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise ImageError(f"cannot decode the {image.format} image: {e}") from e


def rgb_array(image: Image.Image) -> np.ndarray:
    """An RGB PIL image -> a C-contiguous, read-only uint8 array [H, W, 3] over one fresh copy of its pixels.

    `np.asarray(image)` goes through `Image.tobytes`, which encodes in 64 kB chunks and joins them
    (two copies): here the raw encoder writes the whole image in one call.
    """
    if image.mode != "RGB":
        raise ValueError(f"expected an RGB image, got mode {image.mode}")
    width, height = image.size
    return np.frombuffer(_raw_bytes(image, "RGB", width * height * 3), dtype=np.uint8).reshape(height, width, 3)


def channel_planes(image: Image.Image) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An RGB PIL image -> its R, G and B planes: three C-contiguous, read-only uint8 arrays [H, W]."""
    if image.mode != "RGB":
        raise ValueError(f"expected an RGB image, got mode {image.mode}")
    width, height = image.size
    return tuple(  # type: ignore[return-value]
        np.frombuffer(_raw_bytes(image, band, width * height), dtype=np.uint8).reshape(height, width)
        for band in "RGB"
    )


def _raw_bytes(image: Image.Image, rawmode: str, size: int) -> bytes:
    """`image.tobytes("raw", rawmode)` in a single encoder call (falls back to `tobytes` if that fails)."""
    image.load()
    try:
        encoder = Image._getencoder(image.mode, "raw", (rawmode,))
        encoder.setimage(image.im)
        _, status, data = encoder.encode(max(size, 65536))
        if status == 1 and len(data) == size:
            return data
    except Exception:  # noqa: BLE001 - any change in Pillow's internals: take the public path
        pass
    return image.tobytes("raw", rawmode)


_TRANSPOSING_ORIENTATIONS = frozenset(range(2, 9))  # the orientations `ImageOps.exif_transpose` acts on


def _exif_transposed(image: Image.Image) -> Image.Image:
    """vLLM's `ImageOps.exif_transpose(image)` (any failure ignored), then `load()`; pixels as vLLM's.

    `exif_transpose` returns a full copy of the image when there is nothing to transpose; the copy is
    skipped here (same pixels), and `exif_transpose` itself only runs when the orientation asks for a
    transposition. Same order of operations: load, read the EXIF orientation (after loading, as
    `exif_transpose` does: for PNG it may sit after the pixel data), transpose.
    """
    with contextlib.suppress(Exception):  # vLLM ignores any failure here (corrupt EXIF): image as stored
        image.load()
        if image.getexif().get(_EXIF_ORIENTATION_TAG, 1) in _TRANSPOSING_ORIENTATIONS:
            image = ImageOps.exif_transpose(image)
    image.load()
    return image


def _to_rgb(image: Image.Image) -> Image.Image:
    """vLLM's `ImageMediaIO._convert_image_mode` / `convert_image_mode` for target mode RGB."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        on_white = Image.new("RGB", rgba.size, (255, 255, 255))
        on_white.paste(rgba, mask=rgba.split()[3])
        return on_white
    return image.convert("RGB")


@contextlib.contextmanager
def _opened(data: bytes, limits: ImageLimits):
    """Open the image lazily (Pillow parses the header only) and refuse it before decoding if too big."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageError(f"expected image bytes, got {type(data).__name__}")
    if len(data) > limits.max_bytes:
        raise ImageError(f"image is {len(data)} bytes, over the limit of {limits.max_bytes}")
    if len(data) == 0:
        raise ImageError("image is empty")
    try:
        with warnings.catch_warnings():
            # Our own pixel limit is the one that counts; Pillow's bomb warning would only be noise.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
    except Image.DecompressionBombError as e:
        raise ImageError(f"image dimensions are over Pillow's decompression-bomb limit: {e}") from e
    except (Image.UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as e:
        raise ImageError(f"not a JPEG, PNG, WebP, GIF or BMP image ({e})") from e
    try:
        width, height = image.size
        if width <= 0 or height <= 0:
            raise ImageError(f"image header claims {width}x{height} pixels")
        if width * height > limits.max_pixels:
            raise ImageError(
                f"image is {width}x{height} = {width * height} pixels, over the limit of {limits.max_pixels}"
            )
        yield image
    finally:
        image.close()


def _exif_orientation(image: Image.Image) -> int:
    """The EXIF orientation tag (1 if none), read without decoding pixels.

    `Image.getexif()` is header-only for JPEG/WebP, but for PNG it decodes the whole image when the
    eXIf chunk was not seen before the pixel data; so for PNG only an eXIf chunk already parsed from
    the header counts (`info["exif"]`). That matches vLLM for every PNG whose eXIf precedes IDAT, which
    is where the PNG specification puts it.
    """
    with contextlib.suppress(Exception):
        if image.format == "PNG":
            raw = image.info.get("exif")
            if not raw:
                return 1
            exif = Image.Exif()
            exif.load(raw)
        else:
            exif = image.getexif()
        return int(exif.get(_EXIF_ORIENTATION_TAG, 1) or 1)
    return 1

"""Decoding and RGB conversion against vLLM's own media loader, plus the refusal paths."""

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from mmserve.vision.image_io import ImageError, decode_rgb, read_header
from tests.support.defaults import image_limits

LIMITS = image_limits()

import vllm.multimodal.media.image as vllm_image  # noqa: E402  (the reference; installed by setup)


def vllm_decode(data: bytes) -> np.ndarray:
    return np.asarray(vllm_image.ImageMediaIO().load_bytes(data).media)


def base_rgb(seed: int, height: int, width: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    gradient = np.stack([xs * 255 // width, ys * 255 // height, (xs * ys) % 256], axis=-1)
    noise = rng.integers(0, 256, (height, width, 3))
    return np.where(rng.random((height, width, 1)) < 0.3, noise, gradient).astype(np.uint8)


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def mode_image(mode: str, seed: int, height: int = 37, width: int = 53) -> Image.Image:
    rgb = Image.fromarray(base_rgb(seed, height, width))
    rng = np.random.default_rng(seed)
    alpha = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8))
    if mode == "RGBA":
        image = rgb.copy()
        image.putalpha(alpha)
        return image
    if mode == "LA":
        image = rgb.convert("L").convert("LA")
        image.putalpha(alpha)
        return image
    if mode == "I;16":
        return Image.fromarray(base_rgb(seed, height, width)[..., 0].astype(np.uint16) * 257).convert("I;16")
    return rgb.convert(mode)


# (mode, format, extra save options): every conversion branch of vLLM's loader.
CASES = [
    ("RGB", "PNG", {}),
    ("RGB", "JPEG", {"quality": 90}),
    ("RGB", "WEBP", {"lossless": True}),
    ("RGB", "WEBP", {"quality": 80}),
    ("RGB", "BMP", {}),
    ("RGB", "GIF", {}),
    ("RGBA", "PNG", {}),
    ("RGBA", "WEBP", {"lossless": True}),
    ("L", "PNG", {}),
    ("L", "JPEG", {}),
    ("L", "BMP", {}),
    ("LA", "PNG", {}),
    ("P", "PNG", {}),
    ("P", "PNG", {"transparency": 3}),  # palette with a transparent index: composited on white
    ("P", "GIF", {"transparency": 0}),
    ("P", "BMP", {}),
    ("1", "PNG", {}),
    ("1", "BMP", {}),
    ("CMYK", "JPEG", {}),
    ("I;16", "PNG", {}),
]


@pytest.mark.parametrize("index", range(len(CASES)))
def test_decode_matches_vllm(index):
    mode, fmt, options = CASES[index]
    data = encode(mode_image(mode, index), fmt, **options)
    ours = decode_rgb(data, LIMITS)
    theirs = vllm_decode(data)
    assert ours.dtype == np.uint8 and ours.shape == theirs.shape and ours.flags.c_contiguous
    assert np.array_equal(ours, theirs)
    header = read_header(data, LIMITS)
    assert (header.height, header.width) == ours.shape[:2]


def test_rgb_with_png_transparency_key_matches_vllm():
    data = encode(Image.fromarray(base_rgb(5, 20, 30)), "PNG", transparency=(0, 0, 0))
    assert np.array_equal(decode_rgb(data, LIMITS), vllm_decode(data))


def test_animated_gif_first_frame():
    frames = [Image.fromarray(base_rgb(seed, 24, 31)).convert("P") for seed in range(3)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=50)
    data = buffer.getvalue()
    assert np.array_equal(decode_rgb(data, LIMITS), vllm_decode(data))


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_exif_orientation_is_applied_like_vllm(orientation):
    image = Image.fromarray(base_rgb(orientation, 30, 50))
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(image, "JPEG", exif=exif.tobytes(), quality=95)
    ours, theirs = decode_rgb(data, LIMITS), vllm_decode(data)
    assert np.array_equal(ours, theirs)
    header = read_header(data, LIMITS)
    assert (header.height, header.width) == theirs.shape[:2]
    assert (header.width, header.height) == ((30, 50) if orientation in (6, 8) else (50, 30))


def test_non_image_bytes():
    with pytest.raises(ImageError, match="not a JPEG"):
        decode_rgb(b"this is not an image at all" * 10, LIMITS)
    with pytest.raises(ImageError):
        decode_rgb(b"", LIMITS)


def test_disallowed_format():
    data = encode(Image.fromarray(base_rgb(1, 10, 10)), "TIFF")
    with pytest.raises(ImageError):
        decode_rgb(data, LIMITS)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_truncated(fmt):
    data = encode(Image.fromarray(base_rgb(2, 200, 300)), fmt)
    with pytest.raises(ImageError):
        decode_rgb(data[: len(data) // 2], LIMITS)


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose IHDR claims width x height (valid CRCs), with a few bytes of pixel data."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_decompression_bomb_header_is_refused_before_decoding():
    data = png_claiming(50_000, 50_000)
    assert len(data) < 200
    with pytest.raises(ImageError, match="pixels"):
        read_header(data, LIMITS)
    with pytest.raises(ImageError, match="pixels"):
        decode_rgb(data, LIMITS)


def test_pixel_limit_is_ours():
    data = encode(Image.fromarray(base_rgb(3, 100, 100)), "PNG")
    limits = image_limits(max_pixels=100 * 100 - 1)
    with pytest.raises(ImageError, match="over the limit"):
        decode_rgb(data, limits)
    assert decode_rgb(data, image_limits(max_pixels=100 * 100)).shape == (100, 100, 3)


def test_byte_limit():
    data = encode(Image.fromarray(base_rgb(4, 100, 100)), "BMP")
    with pytest.raises(ImageError, match="bytes"):
        decode_rgb(data, image_limits(max_bytes=len(data) - 1))


def test_image_error_is_a_value_error():
    assert issubclass(ImageError, ValueError)

"""Antialiased bicubic resize of uint8 RGB images, byte-identical to torch's CPU kernel.

vLLM 0.32 preprocesses images with the torchvision backend of Hugging Face's image processors, and on
the CPU a uint8 image goes through `torch.nn.functional.interpolate(mode="bicubic", antialias=True,
align_corners=False)` without any float cast. A model sees different tokens for pixels that differ by
one grey level, so "close" is not good enough: this module reproduces that kernel bit for bit
(see /work/shared/notes/exact-resize.md for how the algorithm was established):

- separable, the horizontal pass first, then the vertical one, each rounding and clamping to uint8;
  an axis whose size does not change is skipped;
- per axis, Keys cubic weights (a = -0.5) stretched by the downscale factor, normalised in float64,
  then quantised to int16 at a precision chosen per axis; each output value is
  `clamp((2**(p-1) + sum(w * px)) >> p, 0, 255)`.

Three implementations, all byte-identical to torch; `resize_path()` names the one in use:
- "numba-exact", the default (numba is a dependency): torch's integer loops, compiled
  (`resize_kernels.py`);
- "pillow-simd": if the installed PIL is a pillow-simd build whose resize passes a self-test against the
  numpy path (`scripts/install_pillow_simd.sh` builds it into the project venv; stock Pillow's bicubic
  differs from torch and is never used);
- "numpy-exact", when numba is not installed: float matrix products that are exact (`resize_numpy.py`).

The model pipelines call `resize_channels`, which takes an RGB array or an RGB PIL image (from
`image_io.decode_image`) and returns the three channel planes, each C-contiguous: with pillow-simd a
PIL image is resized as it is and read out band by band, with no numpy round trip and no strided
channels-first transpose.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["CropBox", "resize_channels", "pillow_simd_active", "resize_path", "warm_up"]

# ----------------------------------------------------------------------------------------------
# Weights: torch's `_compute_indices_min_size_weights_aa` + `_compute_index_ranges_int16_weights`
# ----------------------------------------------------------------------------------------------


def _keys_cubic(x: np.ndarray) -> np.ndarray:
    """Keys cubic with a = -0.5 (`HelperInterpCubic::aa_filter`), in torch's evaluation order."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@dataclass(frozen=True)
class AxisWeights:
    """torch's fixed-point resampling weights for one axis."""

    first_input: np.ndarray  # int64 [out]: first input index each output reads
    taps: np.ndarray  # int64 [out]: how many inputs it reads
    weights: np.ndarray  # int64 [out, max_taps]: int16 values, zero past `taps`
    precision: int  # fixed-point bits: output = (2**(p-1) + sum(w * px)) >> p


def axis_weights(in_size: int, out_size: int) -> AxisWeights:
    scale = in_size / out_size  # area_pixel_compute_scale<double>, align_corners=False
    support = 2.0 * scale if scale >= 1.0 else 2.0  # interp_size 4 for bicubic, times 0.5
    max_taps = int(math.ceil(support)) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0

    center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    # C++ casts truncate toward zero; both arguments are >= -support + 0.5 > -inf, and the max() with 0
    # makes truncation of small negatives harmless, exactly as in torch.
    first = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
    stop = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size)
    taps = np.clip(stop - first, 0, max_taps)

    j = np.arange(max_taps, dtype=np.float64)
    raw = _keys_cubic((j[None, :] + first[:, None] - center[:, None] + 0.5) * invscale)
    raw = np.where(j[None, :] < taps[:, None], raw, 0.0)
    # torch sums left to right; numpy's pairwise reduction could round differently, so add columns in order.
    total = np.zeros(out_size, dtype=np.float64)
    for column in range(max_taps):
        total = total + raw[:, column]
    safe_total = np.where(total != 0.0, total, 1.0)
    normalised = np.where(total[:, None] != 0.0, raw / safe_total[:, None], raw)
    wt_max = float(normalised.max(initial=0.0))

    precision = 0
    while precision < 22 and int(0.5 + wt_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = normalised * float(1 << precision)
    # Round half away from zero, then truncate, as `(int16_t)(v < 0 ? v - 0.5 : v + 0.5)`.
    quantised = np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5)).astype(np.int64)
    return AxisWeights(first_input=first, taps=taps, weights=quantised, precision=precision)


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CropBox:
    """A window of the resized image: rows [top, top + height), columns [left, left + width)."""

    top: int
    left: int
    height: int
    width: int


def resize_channels(image, height: int, width: int, crop: CropBox | None = None) -> tuple[np.ndarray, ...]:
    """Resize an RGB image to (height, width) exactly as torch does: the R, G and B planes, each a
    C-contiguous uint8 [h, w] (channels-first: what the model modules want next). With `crop`, only
    that window of the resized image is computed (each output pixel depends only on its own
    neighbourhood, so this is exact and saves the work a centre crop would throw away).

    `image` is an RGB uint8 array [H, W, 3] or an RGB PIL image (`image_io.decode_image`). With
    pillow-simd a PIL image is resized as it is (no copy out to numpy and back), and the planes are
    read out of the result band by band, already channels-first (no strided transpose).
    """
    from PIL import Image

    if isinstance(image, Image.Image):
        if image.mode != "RGB":
            raise ValueError(f"expected an RGB image, got mode {image.mode}")
        in_w, in_h = image.size
    else:
        _check_rgb(image)
        in_h, in_w = image.shape[:2]
    if height <= 0 or width <= 0:
        raise ValueError(f"target size must be positive, got {height}x{width}")
    box = crop or CropBox(0, 0, height, width)
    if box.top < 0 or box.left < 0 or box.top + box.height > height or box.left + box.width > width:
        raise ValueError(f"crop {box} is outside the {height}x{width} resized image")

    resizing = (in_h, in_w) != (height, width)
    is_pil = isinstance(image, Image.Image)
    if resizing and not is_pil and _use_pillow_simd():
        image, is_pil = Image.fromarray(np.ascontiguousarray(image)), True
    if is_pil and (not resizing or _use_pillow_simd()):
        from .image_io import channel_planes

        if resizing:
            image = image.resize((width, height), Image.Resampling.BICUBIC)
        if (box.height, box.width) != (height, width):
            image = image.crop((box.left, box.top, box.left + box.width, box.top + box.height))
        return channel_planes(image)
    if is_pil:
        from .image_io import rgb_array

        image = rgb_array(image)  # stock Pillow: its resize is not exact, ours are
    if resizing:
        if _use_numba():
            from . import resize_kernels

            planes = resize_kernels.resize_planes(image, height, width, box)
        else:
            from . import resize_numpy

            planes = resize_numpy.resize_planes(image, height, width, box)
        return tuple(planes)  # views of one contiguous [3, h, w]
    window = image[box.top : box.top + box.height, box.left : box.left + box.width]
    return tuple(np.ascontiguousarray(window[:, :, channel]) for channel in range(3))


def _check_rgb(rgb: np.ndarray) -> None:
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected an RGB uint8 array [H, W, 3], got {rgb.dtype} {rgb.shape}")


# ----------------------------------------------------------------------------------------------
# Optional pillow-simd fast path
# ----------------------------------------------------------------------------------------------


def _pillow_resize(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    from PIL import Image

    from .image_io import rgb_array

    image = Image.fromarray(np.ascontiguousarray(rgb))
    return rgb_array(image.resize((width, height), Image.Resampling.BICUBIC))


_pillow_simd_verdict: bool | None = None  # None: not checked yet


def _use_pillow_simd() -> bool:
    """True when PIL is a pillow-simd build whose bicubic resize matched the numpy path on a self-test.

    Checked once, lazily, so importing this module stays cheap.
    """
    global _pillow_simd_verdict
    if _pillow_simd_verdict is None:
        _pillow_simd_verdict = _pillow_simd_self_test()
    return _pillow_simd_verdict


def _pillow_simd_self_test() -> bool:
    try:
        importlib.metadata.version("pillow-simd")
    except importlib.metadata.PackageNotFoundError:
        return False  # stock Pillow: its bicubic differs from torch's (precision, pass order)
    rng = np.random.default_rng(20240613)
    noise = rng.integers(0, 256, size=(97, 131, 3), dtype=np.uint8)
    ramp = np.broadcast_to(np.linspace(0, 255, 131).astype(np.uint8)[None, :, None], noise.shape)
    sample = np.where(rng.random(noise.shape) < 0.5, noise, ramp).astype(np.uint8)
    # Downscales, upscales, mixed and single-axis cases: pass order and precision all show up here.
    from . import resize_numpy

    for height, width in ((40, 57), (224, 310), (140, 64), (97, 200), (50, 131), (13, 500)):
        ours = resize_numpy.resize_planes(sample, height, width, CropBox(0, 0, height, width)).transpose(1, 2, 0)
        if not np.array_equal(_pillow_resize(sample, height, width), ours):
            return False
    return True


# ----------------------------------------------------------------------------------------------
# The compiled kernels (numba), the default
# ----------------------------------------------------------------------------------------------

_numba_verdict: bool | None = None  # None: not looked up yet


def _use_numba() -> bool:
    """True when numba is installed (a dependency: only a partial install lacks it).

    Only looked up, not imported: the processes that merely report the path (the ingress, the driver)
    never load numba; the one that resizes imports it on first use, and an import that fails there
    fails loudly rather than fall back to the slower numpy path without anyone noticing.
    """
    global _numba_verdict
    if _numba_verdict is None:
        _numba_verdict = importlib.util.find_spec("numba") is not None
    return _numba_verdict


def warm_up() -> None:
    """Compile the resize in use now (the Preprocessor calls this at start), so no request waits for it."""
    if not _use_pillow_simd() and _use_numba():
        from . import resize_kernels

        resize_kernels.compile_all()


def pillow_simd_active() -> bool:
    """Whether resizes go through pillow-simd (installed and passed its self-test)."""
    return _use_pillow_simd()


def resize_path() -> str:
    """The name of the resize in use, as the service reports it (log, /v1/models, /metrics).

    All three are byte-identical to torch's kernel: "pillow-simd" (scripts/install_pillow_simd.sh),
    "numba-exact" (the default) or "numpy-exact" (numba not installed).
    """
    if _use_pillow_simd():
        return "pillow-simd"
    return "numba-exact" if _use_numba() else "numpy-exact"

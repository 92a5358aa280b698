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

How it is computed here: each pass is a handful of float matrix products over small dense blocks of
the (banded) weight matrix. Every weight is an int16 scaled by 2**-p, so every product and partial sum
is an integer times 2**-p; as long as those integers stay below 2**24 (float32) or 2**53 (float64), BLAS
computes them exactly whatever its summation order, and `floor(sum + 0.5)` equals torch's shift. The
dtype is chosen per axis from that bound (float64 only for strong downscales, about 2x and more).

Speed, one core, 1280x960 -> 1148x840: about 9-11 ms here against torch's 4.5 ms AVX2 kernel; most of
it is memory passes numpy cannot fuse (uint8->float panels, rounding, clamping), not arithmetic.

If the installed PIL is a pillow-simd build whose resize passes a self-test against the numpy path,
it is used instead (≈5x faster); stock Pillow's bicubic differs from torch and is never used
(`scripts/install_pillow_simd.sh` installs it into the project venv).

The model pipelines call `resize_channels`, which takes an RGB array or an RGB PIL image (from
`image_io.decode_image`) and returns the three channel planes, each C-contiguous: with pillow-simd a
PIL image is resized as it is and read out band by band, with no numpy round trip and no strided
channels-first transpose.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import os
from dataclasses import dataclass

import numpy as np

__all__ = ["CropBox", "resize_channels", "pillow_simd_active", "resize_path"]

# Outputs per dense weight block. A block of n outputs reads about n * scale + taps inputs, so smaller
# blocks waste fewer multiplications on the zeros outside the band, larger ones make fewer, better-shaped
# BLAS calls. About 16 outputs measured fastest near scale 1; for strong downscales fewer (env override
# for experiments: MMSERVE_RESIZE_BLOCK).
_BLOCK_INPUTS = int(os.environ.get("MMSERVE_RESIZE_BLOCK", "16"))


def _block_outputs(scale: float) -> int:
    return max(4, round(_BLOCK_INPUTS / max(scale, 1.0)))


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
# Plans: the weights cut into dense blocks, ready for matmul
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Block:
    out_start: int
    out_stop: int
    in_start: int
    in_stop: int
    matrix: np.ndarray  # [out_stop - out_start, in_stop - in_start], weights * 2**-p
    matrix_t: np.ndarray  # its transpose, C-contiguous (the horizontal pass multiplies from the right)


@dataclass(frozen=True)
class _AxisPlan:
    in_size: int
    out_size: int
    dtype: type  # np.float32 when every partial sum is an integer below 2**24, else np.float64
    blocks: tuple[_Block, ...]

    def input_span(self, out_start: int, out_stop: int) -> tuple[int, int]:
        """Which input indices the outputs [out_start, out_stop) read."""
        spans = [(b.in_start, b.in_stop) for b in self.blocks if b.out_start < out_stop and b.out_stop > out_start]
        return min(s for s, _ in spans), max(e for _, e in spans)


@functools.lru_cache(maxsize=256)
def _axis_plan(in_size: int, out_size: int) -> _AxisPlan:
    w = axis_weights(in_size, out_size)
    # Largest magnitude any partial sum (plus the rounding half) can reach, in units of 2**-p.
    bound = 255 * int(np.abs(w.weights).sum(axis=1).max(initial=0)) + (1 << w.precision)
    dtype = np.float32 if bound < (1 << 24) else np.float64
    unit = 2.0 ** -w.precision  # exact: scaling by a power of two keeps every weight an exact float

    blocks = []
    step = _block_outputs(in_size / out_size)
    for start in range(0, out_size, step):
        stop = min(start + step, out_size)
        first = w.first_input[start:stop]
        in_start = int(first.min())
        in_stop = int((first + w.taps[start:stop]).max())
        matrix = np.zeros((stop - start, in_stop - in_start), dtype=np.float64)
        for row, out_index in enumerate(range(start, stop)):
            offset = int(w.first_input[out_index]) - in_start
            count = int(w.taps[out_index])
            matrix[row, offset : offset + count] = w.weights[out_index, :count] * unit
        matrix = matrix.astype(dtype)
        blocks.append(_Block(start, stop, in_start, in_stop, matrix, np.ascontiguousarray(matrix.T)))
    return _AxisPlan(in_size, out_size, dtype, tuple(blocks))


def _round_in_place(values: np.ndarray) -> np.ndarray:
    """floor(v + 0.5) clamped to [0, 255], in place: torch's `(acc + 2**(p-1)) >> p`, then saturation."""
    values += 0.5
    np.floor(values, out=values)
    np.clip(values, 0.0, 255.0, out=values)
    return values


def _round_to_uint8(values: np.ndarray) -> np.ndarray:
    """The same rounding, producing uint8 in two passes instead of three.

    Clamping to [-0.5, 255.49] first makes `v + 0.5` land in [0, 256), where the float-to-uint8 cast
    (truncation) is exactly floor; 255.49 rather than 255.5 keeps 256 out of the cast.
    """
    np.clip(values, -0.5, 255.49, out=values)
    result = np.empty(values.shape, dtype=np.uint8)
    np.add(values, 0.5, out=result, casting="unsafe")
    return result


def _horizontal(rgb_rows: np.ndarray, plan: _AxisPlan, out_lo: int, out_hi: int) -> np.ndarray:
    """rgb_rows uint8 [H, W, 3] -> float [3, H, out_hi - out_lo]: output columns [out_lo, out_hi), rounded.

    Each weight block reads a narrow window of input columns. BLAS reads such a window slowly from a
    wide row-major image (every row is a separate cache line), so each window is converted from uint8
    straight into its own small contiguous channels-first panel (which also replaces a whole-image
    uint8->float conversion). Rounding runs once over the whole result: rounding each block's strided
    output columns separately measured slower.
    """
    height = rgb_rows.shape[0]
    result = np.empty((3 * height, out_hi - out_lo), dtype=plan.dtype)
    for block in plan.blocks:
        lo, hi = max(block.out_start, out_lo), min(block.out_stop, out_hi)
        if lo >= hi:
            continue
        panel = np.empty((3, height, block.in_stop - block.in_start), dtype=plan.dtype)
        panel[...] = rgb_rows[:, block.in_start : block.in_stop].transpose(2, 0, 1)
        weights = block.matrix_t[:, lo - block.out_start : hi - block.out_start]
        np.matmul(panel.reshape(3 * height, -1), weights, out=result[:, lo - out_lo : hi - out_lo])
    return _round_in_place(result).reshape(3, height, out_hi - out_lo)


def _vertical(planes: np.ndarray, plan: _AxisPlan, out_lo: int, out_hi: int, first_row: int) -> np.ndarray:
    """planes [C, H, W] -> [C, out_hi - out_lo, W]: output rows [out_lo, out_hi) of the pass, unrounded.

    `planes` holds input rows from `first_row` on (the rows a crop does not need were never computed).
    """
    channels, _, width = planes.shape
    result = np.empty((channels, out_hi - out_lo, width), dtype=plan.dtype)
    for block in plan.blocks:
        lo, hi = max(block.out_start, out_lo), min(block.out_stop, out_hi)
        if lo >= hi:
            continue
        matrix = block.matrix[lo - block.out_start : hi - block.out_start]
        rows = planes[:, block.in_start - first_row : block.in_stop - first_row, :]
        result[:, lo - out_lo : hi - out_lo, :] = matrix @ rows
    return result


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

        image = rgb_array(image)  # stock Pillow: its resize is not exact, the numpy one is
    if resizing:
        return tuple(_numpy_resize_planes(image, height, width, box))  # views of one contiguous [3, h, w]
    window = image[box.top : box.top + box.height, box.left : box.left + box.width]
    return tuple(np.ascontiguousarray(window[:, :, channel]) for channel in range(3))


def _numpy_resize_planes(rgb: np.ndarray, height: int, width: int, box: CropBox) -> np.ndarray:
    in_h, in_w = rgb.shape[:2]
    rows_plan = _axis_plan(in_h, height) if in_h != height else None
    cols_plan = _axis_plan(in_w, width) if in_w != width else None
    # Input rows the vertical pass reads for the requested output rows (all of them without a crop);
    # input columns: all of them if the horizontal pass runs, else just the crop's.
    if rows_plan is not None:
        row_lo, row_hi = rows_plan.input_span(box.top, box.top + box.height)
    else:
        row_lo, row_hi = box.top, box.top + box.height
    col_lo, col_hi = (0, in_w) if cols_plan is not None else (box.left, box.left + box.width)

    rgb_rows = rgb[row_lo:row_hi, col_lo:col_hi]
    if cols_plan is not None:
        planes = _horizontal(rgb_rows, cols_plan, box.left, box.left + box.width)
        if rows_plan is None:
            return planes.astype(np.uint8)  # already rounded and clamped
    else:
        planes = rgb_rows.transpose(2, 0, 1).astype(rows_plan.dtype)
    return _round_to_uint8(
        _vertical(planes.astype(rows_plan.dtype, copy=False), rows_plan, box.top, box.top + box.height, row_lo)
    )


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
    for height, width in ((40, 57), (224, 310), (140, 64), (97, 200), (50, 131), (13, 500)):
        ours = _numpy_resize_planes(sample, height, width, CropBox(0, 0, height, width)).transpose(1, 2, 0)
        if not np.array_equal(_pillow_resize(sample, height, width), ours):
            return False
    return True


def pillow_simd_active() -> bool:
    """Whether resizes go through pillow-simd (installed and passed its self-test)."""
    return _use_pillow_simd()


def resize_path() -> str:
    """The name of the resize in use, as the service reports it (log, /v1/models, /metrics).

    Both are byte-identical to torch's kernel; "pillow-simd" is the fast one (scripts/install_pillow_simd.sh).
    """
    return "pillow-simd" if _use_pillow_simd() else "numpy-exact"

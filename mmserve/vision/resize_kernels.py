"""torch's uint8 antialiased bicubic resize as compiled loops (numba): the default exact resize.

The arithmetic is torch's own, in integers: per output value `clamp((2**(p-1) + sum(w * px)) >> p, 0, 255)`
with the int16 weights and precision `resize.axis_weights` computes, an int32 accumulator (|w| < 2**15,
px < 2**8 and a tap count in the tens cannot overflow it) and an arithmetic shift, so the bytes are the
same as torch's whatever the machine, with no float reasoning needed (the numpy path's BLAS trick).

Both passes run as "rows of taps times a contiguous row": every inner loop walks contiguous memory
with one weight, which the compiler vectorises. The vertical pass is that shape as the image lies
([H, W, 3] rows); for the horizontal pass the image is first transposed ([W, H, 3]), so that one input
column is one contiguous row, and each output column is scattered back into [H, W', 3]. The last pass
writes channels-first planes (what the model modules read next) directly.

Compiled once per machine and cached on disk (see `_compiled`; the Preprocessor loads or compiles it at
start, `compile_all`); `nogil`,
so the Preprocessor's pixel threads resize in parallel.
"""

from __future__ import annotations

import functools

import numba
import numpy as np

from .resize import CropBox, axis_weights


def _compiled(function):
    """numba.njit, its machine code cached on disk when a cache directory is writable (numba's
    `__pycache__` beside this file, else the user's cache directory): a replica that starts after the
    first loads it in about 0.3 s instead of compiling for 1.7 s. Without one, compiled per process."""
    options = {"nogil": True, "boundscheck": False}
    try:
        return numba.njit(cache=True, **options)(function)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(cache=False, **options)(function)


# Output columns (and transposed input columns) handled together: the scatter between layouts then
# writes BLOCK pixels of one row at a time instead of one pixel per row, while the block's
# accumulators (BLOCK x H x 3 int32) stay in L2.
BLOCK = 16


@_compiled
def transpose_rgb(rgb):
    """uint8 [H, W, 3] -> C-contiguous uint8 [W, H, 3]."""
    height, width = rgb.shape[0], rgb.shape[1]
    out = np.empty((width, height, 3), dtype=np.uint8)
    for x0 in range(0, width, BLOCK):
        x1 = min(x0 + BLOCK, width)
        for y in range(height):
            for x in range(x0, x1):
                out[x, y, 0] = rgb[y, x, 0]
                out[x, y, 1] = rgb[y, x, 1]
                out[x, y, 2] = rgb[y, x, 2]
    return out


@_compiled
def horizontal_pass(columns, first, taps, weights, precision, out_lo, out_hi):
    """The horizontal pass for output columns [out_lo, out_hi).

    columns: C-contiguous uint8 [W, H, 3] (the image transposed); returns uint8 [H, out_hi - out_lo, 3].
    """
    width_in, height = columns.shape[0], columns.shape[1]
    size = height * 3
    flat = columns.reshape(width_in, size)
    out = np.empty((height, out_hi - out_lo, 3), dtype=np.uint8)
    acc = np.empty((BLOCK, size), dtype=np.int32)
    half = np.int32(1 << (precision - 1)) if precision > 0 else np.int32(0)
    for i0 in range(0, out_hi - out_lo, BLOCK):
        i1 = min(i0 + BLOCK, out_hi - out_lo)
        for b in range(i1 - i0):
            column = out_lo + i0 + b
            start = first[column]
            row = acc[b]
            for t in range(size):
                row[t] = half
            for k in range(taps[column]):
                weight = np.int32(weights[column, k])
                source = flat[start + k]
                for t in range(size):
                    row[t] += weight * np.int32(source[t])
        for y in range(height):
            for b in range(i1 - i0):
                for c in range(3):
                    out[y, i0 + b, c] = min(max(acc[b, 3 * y + c] >> precision, 0), 255)
    return out


@_compiled
def vertical_pass_to_planes(rows, first, taps, weights, precision, out_lo, out_hi, first_row):
    """The vertical pass for output rows [out_lo, out_hi), written as channels-first planes.

    rows: C-contiguous uint8 [R, W, 3] holding the input rows from `first_row` on;
    returns uint8 [3, out_hi - out_lo, W].
    """
    width = rows.shape[1]
    flat = rows.reshape(rows.shape[0], width * 3)
    planes = np.empty((3, out_hi - out_lo, width), dtype=np.uint8)
    acc = np.empty(width * 3, dtype=np.int32)
    half = np.int32(1 << (precision - 1)) if precision > 0 else np.int32(0)
    for j in range(out_hi - out_lo):
        row = out_lo + j
        start = first[row] - first_row
        for t in range(width * 3):
            acc[t] = half
        for k in range(taps[row]):
            weight = np.int32(weights[row, k])
            source = flat[start + k]
            for t in range(width * 3):
                acc[t] += weight * np.int32(source[t])
        for x in range(width):
            for c in range(3):
                planes[c, j, x] = min(max(acc[3 * x + c] >> precision, 0), 255)
    return planes


@functools.lru_cache(maxsize=256)
def kernel_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """`axis_weights` in the kernels' argument types: first input and taps int64, weights int16."""
    w = axis_weights(in_size, out_size)
    return w.first_input, w.taps, w.weights.astype(np.int16), w.precision


def resize_planes(rgb: np.ndarray, height: int, width: int, box: CropBox) -> np.ndarray:
    """The resized window `box` of an RGB uint8 [H, W, 3] as one C-contiguous uint8 [3, h, w]."""
    in_h, in_w = rgb.shape[:2]
    rows = kernel_weights(in_h, height) if in_h != height else None
    columns = kernel_weights(in_w, width) if in_w != width else None
    if rows is not None:  # the input rows the requested output rows read
        first, taps = rows[0][box.top : box.top + box.height], rows[1][box.top : box.top + box.height]
        row_lo, row_hi = int(first.min()), int((first + taps).max())
    else:
        row_lo, row_hi = box.top, box.top + box.height

    if columns is not None:
        transposed = transpose_rgb(np.ascontiguousarray(rgb[row_lo:row_hi]))
        middle = horizontal_pass(transposed, *columns, box.left, box.left + box.width)
    else:
        middle = np.ascontiguousarray(rgb[row_lo:row_hi, box.left : box.left + box.width])
    if rows is None:
        return np.ascontiguousarray(middle.transpose(2, 0, 1))
    return vertical_pass_to_planes(middle, *rows, box.top, box.top + box.height, row_lo)


def compile_all() -> None:
    """Compile every kernel now, or load it from numba's cache (numba compiles on first call), so no
    request pays for it.

    numba compiles one specialisation per argument type, and read-only arrays are a type of their own:
    a decoded image (`np.asarray` of a PIL image) is read-only, an array a caller built is not.
    """
    first = np.zeros(4, dtype=np.int64)
    taps = np.ones(4, dtype=np.int64)
    weights = np.ones((4, 1), dtype=np.int16)
    for writeable in (True, False):
        rgb = np.zeros((6, 5, 3), dtype=np.uint8)
        rgb.flags.writeable = writeable
        columns = transpose_rgb(rgb)
        horizontal_pass(columns, first, taps, weights, 1, 0, 4)
        vertical_pass_to_planes(rgb, first, taps, weights, 1, 0, 4, 0)

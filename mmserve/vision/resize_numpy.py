"""The exact resize as float matrix products (numpy + BLAS): the path when numba is not installed.

Each pass is a handful of float matrix products over small dense blocks of the (banded) weight matrix
that `resize.axis_weights` computes. Every weight is an int16 scaled by 2**-p, so every product and
partial sum is an integer times 2**-p; as long as those integers stay below 2**24 (float32) or 2**53
(float64), BLAS computes them exactly whatever its summation order, and `floor(sum + 0.5)` equals
torch's shift. The dtype is chosen per axis from that bound (float64 only for strong downscales, about
2x and more).

It is slower than torch's own kernel: most of its time is memory passes numpy cannot fuse
(uint8->float panels, rounding, clamping), not arithmetic.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from .resize import CropBox, axis_weights

# Outputs per dense weight block. A block of n outputs reads about n * scale + taps inputs, so smaller
# blocks waste fewer multiplications on the zeros outside the band, larger ones make fewer, better-shaped
# BLAS calls; 16 balances the two near scale 1 (env override for experiments: MMSERVE_RESIZE_BLOCK).
_BLOCK_INPUTS = int(os.environ.get("MMSERVE_RESIZE_BLOCK", "16"))


def _block_outputs(scale: float) -> int:
    return max(4, round(_BLOCK_INPUTS / max(scale, 1.0)))


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
    uint8->float conversion). Rounding runs once over the whole result, not per block's strided
    output columns.
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


def resize_planes(rgb: np.ndarray, height: int, width: int, box: CropBox) -> np.ndarray:
    """The resized window `box` of an RGB uint8 [H, W, 3] as one C-contiguous uint8 [3, h, w]."""
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

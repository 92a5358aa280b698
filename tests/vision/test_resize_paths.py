"""The default exact resize (numba) against the numpy one, in the gateway venv as README installs it.

Both are checked against torch itself in tests/vision/test_resize.py (the reference venv); here, with
no torch, the compiled kernels are compared with the numpy path on random sizes, crops and one-axis
resizes, and the quick start's install is shown to take the compiled path.
"""

import numpy as np
import pytest
from PIL import Image

from mmserve.vision import resize as resize_module
from mmserve.vision import resize_numpy
from mmserve.vision.resize import CropBox, resize_channels, resize_path


def test_the_quick_starts_install_resizes_with_the_compiled_kernels():
    assert not resize_module.pillow_simd_active()
    assert resize_path() == "numba-exact"


def _case(index: int) -> tuple[np.ndarray, tuple[int, int], CropBox | None]:
    rng = np.random.default_rng([20261206, index])
    in_h, in_w, out_h, out_w = (int(v) for v in rng.integers(1, 420, 4))
    if index % 5 == 0:
        out_h = in_h  # horizontal pass only
    elif index % 7 == 0:
        out_w = in_w  # vertical pass only
    if (in_h, in_w) == (out_h, out_w):
        out_w += 1
    top, left = int(rng.integers(0, out_h)), int(rng.integers(0, out_w))
    crop = CropBox(top, left, int(rng.integers(1, out_h - top + 1)), int(rng.integers(1, out_w - left + 1)))
    if index % 2:
        rgb = rng.integers(0, 256, (in_h, in_w, 3), dtype=np.uint8)
    else:  # hard edges in saturated colours: the cubic rings past 0 and 255, so the clamping shows
        rgb = np.where(rng.random((in_h, in_w, 1)) < 0.5, 0, 255).astype(np.uint8).repeat(3, axis=2)
    return rgb, (out_h, out_w), (None if index % 3 == 0 else crop)


@pytest.mark.parametrize("index", range(60))
def test_compiled_kernels_equal_the_numpy_resize(index, monkeypatch):
    rgb, (out_h, out_w), crop = _case(index)
    box = crop or CropBox(0, 0, out_h, out_w)
    expected = resize_numpy.resize_planes(rgb, out_h, out_w, box)
    monkeypatch.setattr(resize_module, "_numba_verdict", True)
    for source in (rgb, Image.fromarray(rgb)):
        planes = resize_channels(source, out_h, out_w, crop)
        assert all(plane.flags.c_contiguous and plane.dtype == np.uint8 for plane in planes)
        assert np.array_equal(np.stack(planes), expected), f"{int(np.count_nonzero(np.stack(planes) != expected))} values differ"


def test_a_strided_view_is_resized_like_its_copy(monkeypatch):
    monkeypatch.setattr(resize_module, "_numba_verdict", True)
    rng = np.random.default_rng(3)
    wide = rng.integers(0, 256, (120, 200, 3), dtype=np.uint8)
    view = wide[10:100, 5:190:2]  # not C-contiguous
    assert np.array_equal(np.stack(resize_channels(view, 70, 64)), np.stack(resize_channels(view.copy(), 70, 64)))


def test_warm_up_compiles_what_requests_run():
    """In a fresh process: after `warm_up` (the Preprocessor's start), resizing compiles nothing more."""
    import subprocess
    import sys

    script = """
import numpy as np
from PIL import Image
from mmserve.vision import resize_kernels
from mmserve.vision.resize import CropBox, resize_channels, resize_path, warm_up
assert resize_path() == "numba-exact"
kernels = (resize_kernels.transpose_rgb, resize_kernels.horizontal_pass, resize_kernels.vertical_pass_to_planes)
warm_up()
compiled = [list(kernel.signatures) for kernel in kernels]
assert all(compiled), compiled
rgb = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
for source in (rgb, Image.fromarray(rgb)):
    resize_channels(source, 476, 644)
    resize_channels(source, 476, 640)
    resize_channels(source, 480, 644)
    resize_channels(source, 336, 336, CropBox(10, 20, 100, 200))
assert [list(kernel.signatures) for kernel in kernels] == compiled, "a request compiled a new specialisation"
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)

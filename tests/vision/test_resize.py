"""The numba and numpy resizes against torch's own uint8 antialiased bicubic, computed live in the test."""

import numpy as np
import pytest
import torch

from mmserve.vision import resize as resize_module
from mmserve.vision.resize import CropBox, axis_weights, pillow_simd_active, resize_channels


def resize_rgb(rgb: np.ndarray, height: int, width: int, crop: CropBox | None = None, path: str = "numpy") -> np.ndarray:
    """`resize_channels` on the numba path (the quick start's) or the numpy one (without numba), not
    pillow-simd's, which this venv has (tests/vision/test_fast_paths.py compares that one), as one
    [h, w, 3] image."""
    verdicts = resize_module._pillow_simd_verdict, resize_module._numba_verdict
    resize_module._pillow_simd_verdict, resize_module._numba_verdict = False, path == "numba"
    try:
        return np.stack(resize_channels(rgb, height, width, crop), axis=-1)
    finally:
        resize_module._pillow_simd_verdict, resize_module._numba_verdict = verdicts

torch.set_num_threads(1)


def make_image(seed: int, height: int, width: int) -> np.ndarray:
    """Seeded noise, gradients and hard-edged shapes: smooth areas, edges and clipping all show up."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    kind = seed % 3
    if kind == 0:
        image = rng.integers(0, 256, (height, width, 3))
    elif kind == 1:
        image = np.stack([xs * 255 // max(width - 1, 1), ys * 255 // max(height - 1, 1), (xs + ys) % 256], axis=-1)
    else:
        image = np.full((height, width, 3), rng.integers(0, 256, 3))
        for _ in range(6):  # rectangles and discs in saturated colours: ringing gets clamped
            y0, x0 = rng.integers(0, height), rng.integers(0, width)
            colour = rng.choice([0, 255], 3)
            if rng.random() < 0.5:
                image[y0 : y0 + rng.integers(1, height), x0 : x0 + rng.integers(1, width)] = colour
            else:
                image[(ys - y0) ** 2 + (xs - x0) ** 2 < rng.integers(1, max(height, width)) ** 2] = colour
        image = image + rng.integers(-8, 9, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def torch_resize(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    tensor = torch.from_numpy(rgb).permute(2, 0, 1)[None].contiguous()
    out = torch.nn.functional.interpolate(
        tensor, size=[height, width], mode="bicubic", align_corners=False, antialias=True
    )
    return out[0].permute(1, 2, 0).numpy()


# (input height, width) -> (output height, width): downscales, upscales, mixed, odd, one axis, identity,
# tiny, large and extreme factors (the last ones take the float64 path).
CASES = [
    ((960, 1280), (840, 1148)),
    ((480, 640), (476, 644)),
    ((1080, 1920), (728, 1316)),
    ((30, 30), (56, 56)),
    ((1, 1), (3, 5)),
    ((7, 5), (3, 2)),
    ((37, 91), (200, 33)),
    ((333, 777), (333, 500)),
    ((500, 333), (250, 333)),
    ((100, 100), (100, 101)),
    ((101, 99), (99, 101)),
    ((224, 224), (224, 224)),
    ((1000, 1000), (10, 10)),
    ((4000, 300), (500, 37)),
    ((17, 3000), (28, 3000)),
    ((2048, 1536), (1092, 812)),
    ((641, 479), (336, 249)),
    ((336, 448), (336, 448)),
    ((3, 1000), (28, 5600)),
    ((57, 57), (56, 56)),
] + [
    ((int(h), int(w)), (int(oh), int(ow)))
    for h, w, oh, ow in np.random.default_rng(7).integers(2, 700, size=(16, 4))
]


@pytest.mark.parametrize("path", ["numba", "numpy"])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_resize_matches_torch(index, path):
    (in_h, in_w), (out_h, out_w) = CASES[index]
    rgb = make_image(index, in_h, in_w)
    ours = resize_rgb(rgb, out_h, out_w, path=path)
    reference = torch_resize(rgb, out_h, out_w)
    assert ours.shape == reference.shape and ours.dtype == np.uint8
    assert np.array_equal(ours, reference), f"{int(np.count_nonzero(ours != reference))} values differ"


@pytest.mark.parametrize("path", ["numba", "numpy"])
@pytest.mark.parametrize("index", [0, 1, 6, 9, 16, 20, 25])
def test_cropped_resize_is_the_window_of_the_full_resize(index, path):
    (in_h, in_w), (out_h, out_w) = CASES[index]
    rgb = make_image(100 + index, in_h, in_w)
    reference = torch_resize(rgb, out_h, out_w)
    crop = CropBox(top=out_h // 3, left=out_w // 4, height=max(1, out_h // 2), width=max(1, out_w // 2))
    window = resize_rgb(rgb, out_h, out_w, crop, path=path)
    expected = reference[crop.top : crop.top + crop.height, crop.left : crop.left + crop.width]
    assert np.array_equal(window, expected)


def test_weights_are_int16_and_normalised():
    for in_size, out_size in [(1280, 1148), (640, 644), (4000, 500), (30, 56)]:
        weights = axis_weights(in_size, out_size)
        assert np.abs(weights.weights).max() < 2**15
        sums = weights.weights.sum(axis=1)
        # Each row sums to 2**precision up to the rounding of its taps.
        assert np.all(np.abs(sums - 2**weights.precision) <= weights.taps)


@pytest.mark.parametrize("path", ["numba", "numpy"])
def test_rejects_non_rgb_input(path):
    with pytest.raises(ValueError):
        resize_rgb(np.zeros((4, 4), np.uint8), 2, 2, path=path)
    with pytest.raises(ValueError):
        resize_rgb(np.zeros((4, 4, 3), np.float32), 2, 2, path=path)


def test_pillow_simd_is_used_exactly_when_it_is_installed():
    """Stock Pillow's resize differs from Hugging Face's by a rounding step: the fast path must be
    taken with pillow-simd only (installed in the reference venv by scripts/setup.sh)."""
    import importlib.metadata

    try:
        importlib.metadata.version("pillow-simd")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    assert pillow_simd_active() is installed

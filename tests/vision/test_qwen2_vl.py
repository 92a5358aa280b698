"""Qwen2-VL preprocessing against transformers' Qwen2VLImageProcessor (torchvision backend), live."""

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_smart_resize

from mmserve.vision import PixelDtype, Qwen2VLSettings, decode_rgb, read_header, smart_resize
from tests.support.defaults import image_limits

LIMITS = image_limits()

torch.set_num_threads(1)

# A small max_pixels keeps large inputs cheap while still exercising downscales; min_pixels as shipped.
CONFIG = {
    "min_pixels": 3136,
    "max_pixels": 28 * 28 * 400,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
}


def make_image(seed: int, height: int, width: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    gradient = np.stack([xs * 255 // max(width - 1, 1), ys * 255 // max(height - 1, 1), (xs ^ ys) & 255], axis=-1)
    noise = rng.integers(0, 256, (height, width, 3))
    image = np.where(rng.random((height, width, 1)) < (seed % 4) / 4, noise, gradient)
    for _ in range(seed % 5):  # saturated rectangles: edges that ring and clip
        y0, x0 = rng.integers(0, height), rng.integers(0, width)
        image[y0 : y0 + rng.integers(1, height + 1), x0 : x0 + rng.integers(1, width + 1)] = rng.choice([0, 255], 3)
    return image.astype(np.uint8)


# (height, width): identity sizes (multiples of 28 in bounds), tiny (upscaled to min_pixels), odd,
# one-axis, downscales past max_pixels, extreme aspect ratios, large.
SIZES = [
    (280, 448), (224, 224), (28, 2800), (560, 392),
    (30, 30), (10, 17), (1, 50), (56, 56),
    (480, 640), (481, 641), (333, 777), (999, 101),
    (280, 449), (281, 448), (100, 28 * 14), (28 * 9, 250),
    (960, 1280), (1080, 1920), (1200, 900), (2000, 3000),
    (57, 3001), (3001, 57), (123, 457), (640, 480),
    (700, 700), (513, 511), (29, 29), (300, 20),
    (1024, 768), (768, 1024), (451, 613), (250, 250),
]


@pytest.fixture(scope="module")
def processor():
    return Qwen2VLImageProcessor(**{k: v for k, v in CONFIG.items() if k != "image_processor_type"})


@pytest.fixture(scope="module")
def settings():
    return Qwen2VLSettings.from_config(CONFIG)


def reference(processor, rgb, **kwargs):
    out = processor(images=[Image.fromarray(rgb)], return_tensors="pt", **kwargs)
    return out["pixel_values"], out["image_grid_thw"][0]


@pytest.mark.parametrize("index", range(len(SIZES)))
def test_uint8_patches_are_byte_identical(processor, settings, index):
    rgb = make_image(index, *SIZES[index])
    # vLLM 0.32 with device normalization forces do_rescale and do_normalize off for the call.
    expected, grid = reference(processor, rgb, do_rescale=False, do_normalize=False)
    ours = settings.process(rgb, PixelDtype.UINT8)
    assert ours.pixel_values.dtype == np.uint8 and expected.dtype == torch.uint8
    assert ours.pixel_values.flags.c_contiguous
    assert ours.pixel_values.shape == tuple(expected.shape)
    assert np.array_equal(ours.pixel_values, expected.numpy())
    assert ours.image_grid_thw.dtype == np.int64
    assert np.array_equal(ours.image_grid_thw, grid.numpy())
    assert ours.num_tokens == int(grid.prod()) // 4


@pytest.mark.parametrize("index", range(0, len(SIZES), 3))
def test_normalized_float_and_casts(processor, settings, index):
    rgb = make_image(1000 + index, *SIZES[index])
    expected, grid = reference(processor, rgb)
    assert expected.dtype == torch.float32
    as_float32 = settings.process(rgb, PixelDtype.FLOAT32)
    assert as_float32.pixel_values.dtype == np.float32
    assert np.abs(as_float32.pixel_values - expected.numpy()).max() <= 1e-6
    assert np.array_equal(as_float32.image_grid_thw, grid.numpy())

    as_bf16 = settings.process(rgb, PixelDtype.BFLOAT16)
    torch_bf16_bits = expected.to(torch.bfloat16).view(torch.uint16).numpy()
    assert as_bf16.pixel_values.dtype == np.uint16
    assert np.array_equal(as_bf16.pixel_values, torch_bf16_bits)

    as_fp16 = settings.process(rgb, PixelDtype.FLOAT16)
    assert np.array_equal(as_fp16.pixel_values.view(np.uint16), expected.to(torch.float16).view(torch.uint16).numpy())


@pytest.mark.parametrize("index", range(0, len(SIZES), 2))
def test_num_image_tokens_from_header(processor, settings, index):
    height, width = SIZES[index]
    buffer = io.BytesIO()
    Image.fromarray(make_image(index, height, width)).save(buffer, "PNG")
    header = read_header(buffer.getvalue(), LIMITS)
    _, grid = reference(processor, decode_rgb(buffer.getvalue(), LIMITS), do_rescale=False, do_normalize=False)
    assert settings.num_image_tokens(header.width, header.height) == int(grid.prod()) // 4
    assert settings.num_image_tokens(width, height) * 4 == processor.get_number_of_image_patches(height, width)


def test_smart_resize_matches_hf():
    rng = np.random.default_rng(3)
    for height, width in rng.integers(1, 5000, size=(2000, 2)):
        height, width = int(height), int(width)
        if max(height, width) / min(height, width) > 200:
            with pytest.raises(ValueError):
                smart_resize(height, width, 28, 3136, 1003520)
            continue
        assert smart_resize(height, width, 28, 3136, 1003520) == hf_smart_resize(height, width, 28, 3136, 1003520)


def test_config_styles_resolve_like_hf(tmp_path):
    newer = {"size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 100 * 28 * 28}, "patch_size": 14,
             "temporal_patch_size": 2, "merge_size": 2, "do_normalize": True}
    older = {"min_pixels": 4 * 28 * 28, "max_pixels": 100 * 28 * 28, "size": {"shortest_edge": 1, "longest_edge": 2}}
    for config in (newer, older, {}):
        path = tmp_path / "preprocessor_config.json"
        path.write_text(json.dumps(config))
        ours = Qwen2VLSettings.from_file(path)
        hf = Qwen2VLImageProcessor(**config)
        assert (ours.min_pixels, ours.max_pixels) == (hf.size["shortest_edge"], hf.size["longest_edge"])
        rgb = make_image(11, 500, 300)
        expected, _ = reference(hf, rgb, do_rescale=False, do_normalize=False)
        assert np.array_equal(ours.process(rgb).pixel_values, expected.numpy())


def test_content_hash(settings):
    rgb = make_image(5, 300, 400)
    first = settings.process(rgb)
    assert len(first.content_hash) == 64 and first.content_hash == settings.process(rgb.copy()).content_hash
    changed = rgb.copy()
    changed[0, 0, 0] ^= 1
    assert settings.process(changed).content_hash != first.content_hash
    assert settings.process(rgb, PixelDtype.BFLOAT16).content_hash != first.content_hash
    other = Qwen2VLSettings.from_config({**CONFIG, "max_pixels": 28 * 28 * 401})
    assert other.process(rgb).content_hash != first.content_hash

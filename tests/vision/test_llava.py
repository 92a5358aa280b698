"""LLaVA-1.5 preprocessing against transformers' CLIPImageProcessor (torchvision backend), live."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import CLIPImageProcessor

from mmserve.vision import LlavaSettings, PixelDtype

torch.set_num_threads(1)

# llava-hf/llava-1.5-7b-hf's preprocessor_config.json
CONFIG = {
    "crop_size": {"height": 336, "width": 336},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "CLIPImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"shortest_edge": 336},
}


def make_image(seed: int, height: int, width: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    gradient = np.stack([(xs * 7) % 256, ys * 255 // max(height - 1, 1), (xs + 2 * ys) % 256], axis=-1)
    noise = rng.integers(0, 256, (height, width, 3))
    image = np.where(rng.random((height, width, 1)) < (seed % 3) / 3, noise, gradient)
    for _ in range(seed % 4):
        y0, x0 = rng.integers(0, height), rng.integers(0, width)
        image[y0 : y0 + rng.integers(1, height + 1), x0 : x0 + rng.integers(1, width + 1)] = rng.choice([0, 255], 3)
    return image.astype(np.uint8)


SIZES = [
    (336, 336), (480, 640), (640, 480), (1080, 1920), (1920, 1080), (30, 30), (1, 1), (17, 400),
    (400, 17), (337, 335), (335, 337), (500, 500), (960, 1280), (336, 1000), (1000, 336), (123, 456),
    (777, 333), (2000, 1500), (99, 100), (3000, 200), (336, 337), (672, 672), (1024, 768), (250, 251),
    (601, 599), (45, 90), (900, 60), (341, 512), (512, 341), (700, 1000),
]


@pytest.fixture(scope="module")
def processor():
    return CLIPImageProcessor(**{k: v for k, v in CONFIG.items() if k != "image_processor_type"})


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava") / "preprocessor_config.json"
    path.write_text(json.dumps(CONFIG))
    return LlavaSettings.from_file(path)


@pytest.mark.parametrize("index", range(len(SIZES)))
def test_pixel_values_match_clip_processor(processor, settings, index):
    rgb = make_image(index, *SIZES[index])
    expected = processor(images=[Image.fromarray(rgb)], return_tensors="pt")["pixel_values"][0]
    assert tuple(expected.shape) == (3, 336, 336) and expected.dtype == torch.float32

    as_float32 = settings.process(rgb, PixelDtype.FLOAT32)
    assert as_float32.pixel_values.shape == (3, 336, 336) and as_float32.pixel_values.flags.c_contiguous
    assert np.abs(as_float32.pixel_values - expected.numpy()).max() <= 1e-6

    as_bf16 = settings.process(rgb, PixelDtype.BFLOAT16)
    assert np.array_equal(as_bf16.pixel_values, expected.to(torch.bfloat16).view(torch.uint16).numpy())

    as_fp16 = settings.process(rgb, PixelDtype.FLOAT16)
    assert np.array_equal(as_fp16.pixel_values.view(np.uint16), expected.to(torch.float16).view(torch.uint16).numpy())
    assert as_float32.num_tokens == 576


def test_int_style_config():
    settings = LlavaSettings.from_config({"size": 336, "crop_size": 336})
    assert (settings.shortest_edge, settings.crop_height, settings.crop_width) == (336, 336, 336)
    assert settings.num_image_tokens == 576


def test_uint8_is_refused(settings):
    with pytest.raises(ValueError):
        settings.process(make_image(0, 400, 400), PixelDtype.UINT8)


def test_content_hash(settings):
    rgb = make_image(3, 500, 700)
    first = settings.process(rgb, PixelDtype.BFLOAT16)
    assert len(first.content_hash) == 64
    assert first.content_hash == settings.process(rgb.copy(), PixelDtype.BFLOAT16).content_hash
    assert first.content_hash != settings.process(rgb, PixelDtype.FLOAT32).content_hash
    edited = rgb.copy()
    edited[250, 350] = 255 - edited[250, 350]  # inside the crop
    assert first.content_hash != settings.process(edited, PixelDtype.BFLOAT16).content_hash

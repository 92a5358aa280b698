"""Each image family's engine fields against the Hugging Face processor vLLM 0.32 loads for the model
directory (``AutoProcessor.from_pretrained(dir).image_processor``, torchvision backend): uint8 patches
byte-identical (device normalisation: vLLM calls the processor with rescale and normalise off),
normalised patches cast to bf16 byte-identical, the same grid and token counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mmserve.multimodal import load_image_family
from mmserve.vision import PixelDtype

from tests.support.tiny_models import write_qwen2_5_vl_files, write_qwen3_vl_files
from tests.vision.test_qwen2_vl import make_image

torch.set_num_threads(1)

# (height, width): identity, upscale below min_pixels, downscale past max_pixels, odd, extreme ratios.
SIZES = [(280, 448), (30, 20), (640, 480), (481, 641), (57, 3001), (1, 50), (999, 101), (513, 511)]
FAMILY_DIRS = {"qwen2_5_vl": write_qwen2_5_vl_files, "qwen3_vl": write_qwen3_vl_files}


@pytest.fixture(scope="module", params=sorted(FAMILY_DIRS))
def family_and_processor(request, tmp_path_factory):
    from transformers import AutoProcessor

    path = FAMILY_DIRS[request.param](tmp_path_factory.mktemp(request.param))
    return request.param, load_image_family(path), AutoProcessor.from_pretrained(str(path)).image_processor


def _hf(processor, rgb: np.ndarray, **kwargs):
    out = processor(images=[Image.fromarray(rgb)], return_tensors="pt", **kwargs)
    return out["pixel_values"], out["image_grid_thw"]


def _fields(processed) -> dict[str, np.ndarray]:
    return {f.name: f.array for f in processed.fields}


@pytest.mark.parametrize("index", range(len(SIZES)))
def test_uint8_patches_byte_identical(family_and_processor, index):
    name, family, processor = family_and_processor
    rgb = make_image(index, *SIZES[index])
    expected, grid = _hf(processor, rgb, do_rescale=False, do_normalize=False)
    ours = family.process(rgb, PixelDtype.UINT8)
    fields = _fields(ours)
    assert expected.dtype == torch.uint8
    assert fields["pixel_values"].tobytes() == expected.numpy().tobytes(), name
    assert fields["pixel_values"].shape == tuple(expected.shape)
    assert np.array_equal(fields["image_grid_thw"], grid[0].numpy())
    # Qwen3-VL: 3 x 2 x 16 x 16 = 1536 values per patch (Qwen2.5-VL: 3 x 2 x 14 x 14 = 1176).
    assert fields["pixel_values"].shape[1] == {"qwen2_5_vl": 1176, "qwen3_vl": 1536}[name]
    merge = processor.merge_size**2
    assert ours.num_tokens == int(grid.prod()) // merge == family.num_tokens(SIZES[index][1], SIZES[index][0])


@pytest.mark.parametrize("index", range(len(SIZES)))
def test_normalized_bf16_patches_byte_identical(family_and_processor, index):
    name, family, processor = family_and_processor
    rgb = make_image(100 + index, *SIZES[index])
    expected, _ = _hf(processor, rgb)
    ours = _fields(family.process(rgb, PixelDtype.BFLOAT16))["pixel_values"]
    assert ours.tobytes() == expected.to(torch.bfloat16).view(torch.uint16).numpy().tobytes(), name

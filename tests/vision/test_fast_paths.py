"""The fast paths of mmserve.vision against the straightforward computations they replace.

- normalisation through lookup tables == elementwise `Normalization.apply` + `cast_float32`;
- the `void`-row patchify == the reshape/transpose layout, for several patch/merge/temporal sizes;
- hashing channel planes == hashing the stacked array (the hash values did not change);
- `decode_image` + `process(PIL image)` == `decode_rgb` + `process(array)`, and EXIF orientation as vLLM;
- the numpy resize stays exact (against torch) even when pillow-simd is active, and the two paths agree.
"""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from mmserve.vision import LlavaSettings, Normalization, PixelDtype, Qwen2VLSettings, decode_rgb
from mmserve.vision import resize as resize_module
from mmserve.vision.hashing import content_hash
from mmserve.vision.image_io import channel_planes, decode_image, rgb_array
from mmserve.vision.pixels import cast_float32, lookup_tables
from mmserve.vision.resize import CropBox, resize_channels
from tests.support.defaults import image_limits

LIMITS = image_limits()

torch.set_num_threads(1)

FLOAT_DTYPES = [PixelDtype.FLOAT32, PixelDtype.FLOAT16, PixelDtype.BFLOAT16]
NORMALIZATIONS = [
    Normalization(),
    Normalization(image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5)),
    Normalization(do_normalize=False),
    Normalization(do_rescale=False),
    Normalization(do_rescale=False, do_normalize=False),
    Normalization(rescale_factor=1 / 127.5, image_mean=(0.1, 0.2, 0.3), image_std=(1e-3, 7.0, 0.3)),
]


def noise(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


@pytest.mark.parametrize("normalization", NORMALIZATIONS, ids=range(len(NORMALIZATIONS)))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.value)
def test_lookup_equals_elementwise_arithmetic(normalization, dtype):
    for shape in [(3, 1, 256), (3, 37, 90), (3, 5, 7), (3, 1, 1)]:  # every value; even and odd widths
        planes = noise(shape[1] * shape[2], *shape)
        if shape[2] == 256:
            planes[:] = np.arange(256, dtype=np.uint8)
        expected = cast_float32(normalization.apply(planes), dtype)
        got = normalization.lookup(list(planes), dtype)
        assert all(g.flags.c_contiguous and g.dtype == dtype.numpy_dtype for g in got)
        assert np.stack(got).tobytes() == np.ascontiguousarray(expected).tobytes()
        # Non-contiguous planes (e.g. windows of a larger image) too.
        window = [plane[:, 1:] for plane in planes]
        assert np.stack(normalization.lookup(window, dtype)).tobytes() == np.ascontiguousarray(expected[:, :, 1:]).tobytes()


def test_pair_table_layout():
    single, pairs = lookup_tables(Normalization(), PixelDtype.BFLOAT16)
    assert single.shape == (3, 256) and pairs.shape == (3, 65536) and not pairs.flags.writeable
    lo, hi = 17, 230
    assert pairs[1, lo + 256 * hi] == int(single[1, lo]) | (int(single[1, hi]) << 16)


def reference_patchify(planes: np.ndarray, p: int, m: int, t: int) -> np.ndarray:
    """Hugging Face's Qwen2-VL reshape/transpose, written out with numpy."""
    channels, height, width = planes.shape
    frames = np.repeat(planes[None], t, axis=0)  # (T, C, H, W)
    gh, gw = height // p, width // p
    patches = frames.reshape(1, t, channels, gh // m, m, p, gw // m, m, p)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(gh * gw, channels * t * p * p)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.float32, np.float16])
@pytest.mark.parametrize("p,m,t", [(14, 2, 2), (16, 2, 2), (14, 1, 1), (7, 3, 3), (2, 2, 2)])
def test_patchify_matches_reference_layout(dtype, p, m, t):
    settings = Qwen2VLSettings(patch_size=p, merge_size=m, temporal_patch_size=t)
    height, width = p * m * 3, p * m * 5
    planes = np.random.default_rng(p * m * t).integers(0, 255, (3, height, width)).astype(dtype)
    expected = reference_patchify(planes, p, m, t)
    got = settings._patchify_planes(list(planes))
    assert got.flags.c_contiguous and got.dtype == planes.dtype
    assert got.tobytes() == expected.tobytes()


def test_hashing_planes_equals_hashing_the_stack():
    stack = noise(3, 3, 40, 56)
    fields = dict(family="qwen2_vl", settings="s", output_dtype="uint8")
    assert content_hash(**fields, pixels=list(stack)) == content_hash(**fields, pixels=stack)
    assert content_hash(**fields, pixels=tuple(np.ascontiguousarray(stack[:, :, :50]))) == content_hash(
        **fields, pixels=stack[:, :, :50]
    )
    with pytest.raises(ValueError):
        content_hash(**fields, pixels=[stack[0], stack[1, :, :3]])


def test_hash_values_are_unchanged():
    """The hashed bytes and fields are what they were before the planes refactor (value from the old code)."""
    rng = np.random.default_rng(42)
    rgb = rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)
    pinned = content_hash(family="qwen2_vl", settings="x", output_dtype="uint8", pixels=rgb.transpose(2, 0, 1))
    assert pinned == "419cbe92328900c30600712cd0d15da11efbeb3ec361f2c54d35312eb65146b0"


def photo(seed: int, height: int, width: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    image = np.stack([xs * 255 // max(width - 1, 1), ys * 255 // max(height - 1, 1), (xs * ys) % 256], axis=-1)
    return np.clip(image + rng.integers(-20, 21, image.shape), 0, 255).astype(np.uint8)


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


# Resized (downscale, upscale), identity (multiples of 28 in bounds), one axis, large, crops for LLaVA.
SHAPES = [(480, 640), (960, 1280), (280, 448), (336, 336), (30, 30), (57, 901), (1080, 1920), (336, 500)]


@pytest.mark.parametrize("shape", SHAPES)
def test_process_pil_image_equals_process_array(shape):
    data = encode(Image.fromarray(photo(sum(shape), *shape)), "JPEG", quality=90)
    rgb, image = decode_rgb(data, LIMITS), decode_image(data, LIMITS)
    assert image.mode == "RGB" and image.size == (rgb.shape[1], rgb.shape[0])
    assert np.array_equal(rgb_array(image), rgb)
    assert np.array_equal(np.stack(channel_planes(image)), rgb.transpose(2, 0, 1))
    qwen = Qwen2VLSettings(max_pixels=28 * 28 * 600)
    for dtype in PixelDtype:
        a, b = qwen.process(rgb, dtype), qwen.process(image, dtype)
        assert a.pixel_values.tobytes() == b.pixel_values.tobytes() and a.content_hash == b.content_hash
        assert np.array_equal(a.image_grid_thw, b.image_grid_thw)
    llava = LlavaSettings()
    for dtype in FLOAT_DTYPES:
        a, b = llava.process(rgb, dtype), llava.process(image, dtype)
        assert a.pixel_values.tobytes() == b.pixel_values.tobytes() and a.content_hash == b.content_hash
        assert a.pixel_values.flags.c_contiguous and a.pixel_values.shape == (3, 336, 336)


def test_decode_image_survives_the_source_and_is_independent():
    data = encode(Image.fromarray(photo(1, 50, 70)), "PNG")
    first = decode_image(data, LIMITS)
    second = decode_image(data, LIMITS)
    assert np.array_equal(rgb_array(first), decode_rgb(data, LIMITS))
    first.paste((0, 0, 0), (0, 0, 10, 10))
    assert not np.array_equal(rgb_array(first), rgb_array(second))
    assert np.array_equal(rgb_array(second), decode_rgb(data, LIMITS))


import vllm.multimodal.media.image as vllm_image  # noqa: E402  (the reference; installed by setup)


@pytest.mark.parametrize("orientation", range(0, 10))
@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "PNG"])
def test_every_exif_orientation_like_vllm(fmt, orientation):
    image = Image.fromarray(photo(orientation, 30, 50))
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(image, fmt, exif=exif.tobytes(), **({"lossless": True} if fmt == "WEBP" else {}))
    theirs = np.asarray(vllm_image.ImageMediaIO().load_bytes(data).media)
    assert np.array_equal(decode_rgb(data, LIMITS), theirs)
    assert np.array_equal(rgb_array(decode_image(data, LIMITS)), theirs)


def torch_resize(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    tensor = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1)[None].contiguous()
    out = torch.nn.functional.interpolate(tensor, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    return out[0].numpy()


@pytest.fixture
def numpy_resize_only(monkeypatch):
    monkeypatch.setattr(resize_module, "_pillow_simd_verdict", False)
    monkeypatch.setattr(resize_module, "_numba_verdict", False)


@pytest.fixture
def numba_resize_only(monkeypatch):
    monkeypatch.setattr(resize_module, "_pillow_simd_verdict", False)
    monkeypatch.setattr(resize_module, "_numba_verdict", True)


CASES = [((960, 1280), (840, 1148)), ((480, 640), (476, 644)), ((1080, 1920), (728, 1316)), ((37, 91), (200, 33)),
         ((333, 777), (333, 500)), ((1000, 1000), (10, 10)), ((224, 224), (224, 224))]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("path", ["numpy_resize_only", "numba_resize_only"])
def test_compiled_and_numpy_resize_channels_match_torch_even_with_pillow_simd_installed(path, case, request):
    request.getfixturevalue(path)
    assert resize_module.resize_path() == {"numpy_resize_only": "numpy-exact", "numba_resize_only": "numba-exact"}[path]
    (in_h, in_w), (out_h, out_w) = case
    rgb = photo(in_h + out_w, in_h, in_w)
    expected = torch_resize(rgb, out_h, out_w)
    for source in (rgb, Image.fromarray(rgb)):
        planes = resize_channels(source, out_h, out_w)
        assert all(plane.flags.c_contiguous and plane.dtype == np.uint8 for plane in planes)
        assert np.array_equal(np.stack(planes), expected)
    crop = CropBox(out_h // 4, out_w // 3, max(1, out_h // 2), max(1, out_w // 2))
    window = expected[:, crop.top : crop.top + crop.height, crop.left : crop.left + crop.width]
    assert np.array_equal(np.stack(resize_channels(rgb, out_h, out_w, crop)), window)


@pytest.mark.parametrize("case", CASES)
def test_pillow_simd_channels_match_torch(case):
    # scripts/setup.sh installs pillow-simd; without it this exact fast path is not in use.
    assert resize_module.pillow_simd_active(), "pillow-simd is not installed (run scripts/install_pillow_simd.sh)"
    (in_h, in_w), (out_h, out_w) = case
    rgb = photo(in_h + out_w, in_h, in_w)
    expected = torch_resize(rgb, out_h, out_w)
    for source in (rgb, Image.fromarray(rgb)):
        assert np.array_equal(np.stack(resize_channels(source, out_h, out_w)), expected)
    crop = CropBox(out_h // 4, out_w // 3, max(1, out_h // 2), max(1, out_w // 2))
    window = expected[:, crop.top : crop.top + crop.height, crop.left : crop.left + crop.width]
    assert np.array_equal(np.stack(resize_channels(Image.fromarray(rgb), out_h, out_w, crop)), window)


def test_resize_channels_rejects_bad_input():
    with pytest.raises(ValueError):
        resize_channels(Image.new("RGBA", (4, 4)), 2, 2)
    with pytest.raises(ValueError):
        resize_channels(np.zeros((4, 4), np.uint8), 2, 2)
    with pytest.raises(ValueError):
        resize_channels(np.zeros((4, 4, 3), np.uint8), 2, 2, CropBox(1, 1, 2, 2))

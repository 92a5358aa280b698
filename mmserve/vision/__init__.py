"""Image preprocessing for the gateway: bytes -> the exact pixels vLLM 0.32 would send its engine.

numpy + Pillow only (never torch, transformers or vllm). One module per model family:

    header = read_header(data, limits)                       # size without decoding; limits checked
    rgb = decode_rgb(data, limits)                           # image_io: EXIF, mode -> RGB
    qwen = Qwen2VLSettings.from_file("preprocessor_config.json")
    qwen.num_image_tokens(header.width, header.height)       # before decoding
    image = qwen.process(rgb, PixelDtype.UINT8)              # pixel_values, image_grid_thw, num_tokens
    image.content_hash                                       # the engine's mm_hash / identifier
"""

from .image_io import ImageError, ImageHeader, ImageLimits, decode_image, decode_rgb, read_header
from .llava import LlavaImage, LlavaSettings
from .pixels import Normalization, PixelDtype
from .qwen2_vl import Qwen2VLImage, Qwen2VLSettings, smart_resize
from .resize import pillow_simd_active, resize_path
from .resize import warm_up as warm_up_resize

__all__ = [
    "ImageError",
    "ImageHeader",
    "ImageLimits",
    "LlavaImage",
    "LlavaSettings",
    "Normalization",
    "PixelDtype",
    "Qwen2VLImage",
    "Qwen2VLSettings",
    "decode_image",
    "decode_rgb",
    "read_header",
    "pillow_simd_active",
    "resize_path",
    "smart_resize",
    "warm_up_resize",
]

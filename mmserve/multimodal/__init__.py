"""Images: the preprocessing request/response types, model families, the preprocessor (fetch →
decode → process), what the engine client expands a prompt with, and the images it recalls."""

from .families import ImageFamily, LlavaFamily, Qwen2VLFamily, UnsupportedImageFamily, load_image_family, pixel_dtype_for
from .features import PlaceholderMismatch, attach_images, expand_image_placeholders
from .types import ImageBatchRequest, ImageField, PixelMode, ProcessedImage, ProcessedImages

__all__ = [
    "ImageBatchRequest", "ImageFamily", "ImageField", "LlavaFamily", "PixelMode", "PlaceholderMismatch",
    "ProcessedImage", "ProcessedImages", "Qwen2VLFamily", "UnsupportedImageFamily", "attach_images",
    "expand_image_placeholders", "load_image_family", "pixel_dtype_for",
]

"""Preprocessor deployment: the CPU-heavy image tier, autoscaled on its own.

Its return value (`ProcessedImages`, numpy arrays inside) is written once to the Ray object
store; the ingress passes the response on to the engine client without awaiting it, so the
pixels go from this replica to the engine client's ZMQ socket with no further copy.
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve

from mmserve.multimodal import ImageBatchRequest, ImagesRefused, ProcessedImages, load_image_family
from mmserve.multimodal.errors import ImageInputError
from mmserve.multimodal.preprocessor import ImagePreprocessor, PreprocessorLimits
from mmserve.vision import ImageLimits, resize_path
from mmserve.fetch import FetchPolicy
from serve_app.config import AppConfig, ImagesConfig

logger = logging.getLogger("ray.serve")


def fetch_policy(images: ImagesConfig) -> FetchPolicy:
    return FetchPolicy(
        max_image_bytes=images.max_image_bytes,
        fetch_timeout_s=images.fetch_timeout_s,
        max_redirects=images.max_redirects,
        allow_private_networks=images.allow_private_networks,
        allowed_hosts=tuple(images.allowed_hosts),
        allowed_local_dir=images.allowed_local_dir,
    )


def build_preprocessor(config: AppConfig) -> ImagePreprocessor:
    family = load_image_family(config.model_dir)
    if family is None:
        raise ValueError(f"{config.model_dir} is not a vision model this gateway can preprocess for")
    images = config.images
    limits = PreprocessorLimits(
        max_images_per_request=images.max_images_per_request,
        image=ImageLimits(max_bytes=images.max_image_bytes, max_pixels=images.max_image_pixels),
    )
    return ImagePreprocessor(family, fetch_policy(images), limits, cache_bytes=images.cache_bytes)


@serve.deployment(name="Preprocessor")
class PreprocessorDeployment:
    def __init__(self, config: dict[str, Any]) -> None:
        app_config = AppConfig.model_validate(config)
        self.preprocessor = build_preprocessor(app_config)
        logger.info(
            "preprocessor for %s images (pixel mode %s; image resize path: %s)",
            self.preprocessor.family.name, app_config.images.pixel_mode, resize_path(),
        )

    async def process(self, request: ImageBatchRequest) -> ProcessedImages | ImagesRefused:
        """A refused image is an answer, not a failure: one INFO line here, a 400 for the client."""
        try:
            return await self.preprocessor.process(request)
        except ImageInputError as exc:
            logger.info("image refused: %s", str(exc)[:300])
            return ImagesRefused(str(exc), exc.index)


def preprocessor_options(config: AppConfig) -> dict[str, Any]:
    p = config.preprocessor
    return {
        "ray_actor_options": {"num_cpus": p.num_cpus},
        "max_ongoing_requests": p.max_ongoing_requests,
        "max_queued_requests": p.max_queued_requests,
        "autoscaling_config": {
            "min_replicas": p.min_replicas,
            "max_replicas": p.max_replicas,
            "target_ongoing_requests": p.target_ongoing_requests,
            "upscale_delay_s": p.upscale_delay_s,
            "downscale_delay_s": p.downscale_delay_s,
            "look_back_period_s": p.look_back_period_s,
            "metrics_interval_s": min(1.0, p.look_back_period_s / 2),
        },
    }

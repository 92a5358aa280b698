"""Preprocessor deployment: the CPU-heavy image tier, autoscaled on its own, with its options beside it.

Its return value (`ProcessedImages`, numpy arrays inside) is written once to the Ray object
store and read where it is sent to the engine, the engine client, which either called this
replica itself or was handed the ingress's response unawaited (`preprocessor_calls.py`): the
pixels go from this replica to the engine client's ZMQ socket with no further copy. (An answer
under Ray's 100-KiB inline limit, a small image's, is returned inline to the caller instead:
cheap at that size.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from ray import serve

from mmserve.fetch import FetchPolicy
from mmserve.multimodal import ImageBatchRequest, ImagesRefused, ProcessedImages, load_image_family
from mmserve.multimodal.errors import ImageInputError, PreprocessorBusyError, images_refused
from mmserve.multimodal.preprocessor import ImagePreprocessor, PreprocessorLimits
from mmserve.vision import resize_path, warm_up_resize

from .inline_args import join_payloads
from .replica_logs import log_package_to_replica

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class PreprocessorSettings:
    """What one preprocessor replica needs, made by `serve_app` from the application's config."""

    model_dir: Path
    fetch: FetchPolicy
    limits: PreprocessorLimits
    cache_bytes: int
    pixel_mode: str  # for the start-up log: the ingress asks per request
    # Threads decoding and resizing at once: the CPUs the replica reserves (`preprocessor.num_cpus`).
    pixel_threads: int


@dataclass(frozen=True)
class PreprocessorScaling:
    """The deployment's CPU reservation, autoscaling and queue (`preprocessor.*` in the config)."""

    num_cpus: float
    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float
    upscale_delay_s: float
    downscale_delay_s: float
    look_back_period_s: float
    max_ongoing_requests: int
    # Requests waiting for a preprocessor replica; beyond: 503 with Retry-After.
    max_queued_requests: int

    def options(self) -> dict[str, Any]:
        """`PreprocessorDeployment.options(...)` for this scaling."""
        return {
            "ray_actor_options": {"num_cpus": self.num_cpus},
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "autoscaling_config": {
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
                "look_back_period_s": self.look_back_period_s,
                "metrics_interval_s": min(1.0, self.look_back_period_s / 2),
            },
        }


def build_preprocessor(settings: PreprocessorSettings) -> ImagePreprocessor:
    family = load_image_family(settings.model_dir)
    if family is None:
        raise ValueError(f"{settings.model_dir} is not a vision model this gateway can preprocess for")
    return ImagePreprocessor(
        family, settings.fetch, settings.limits, cache_bytes=settings.cache_bytes, pixel_threads=settings.pixel_threads
    )


# No access line per call: each is one image request, which the ingress's access line records.
@serve.deployment(name="Preprocessor", logging_config={"enable_access_log": False})
class PreprocessorDeployment:
    def __init__(self, settings: PreprocessorSettings) -> None:
        log_package_to_replica()
        self.preprocessor = build_preprocessor(settings)
        warm_up_resize()  # compiling the resize takes ≈2 s (0.3 s from numba's cache): now, not in a request
        logger.info(
            "preprocessor for %s images (pixel mode %s; image resize path: %s; %d pixel thread(s))",
            self.preprocessor.family.name, settings.pixel_mode, resize_path(), settings.pixel_threads,
        )

    async def process(
        self, request: ImageBatchRequest, piece_counts: list[int] | None = None, *pieces: str
    ) -> ProcessedImages | ImagesRefused:
        """A refusal is an answer, not a failure: one INFO line here, a 400, 413 or 503 for the client.
        With `piece_counts`, the request's payloads came cut into `pieces` (`inline_args.py`)."""
        if piece_counts is not None:
            request = msgspec.structs.replace(request, urls=join_payloads(piece_counts, pieces))
        try:
            return await self.preprocessor.process(request)
        except (ImageInputError, PreprocessorBusyError) as exc:
            logger.info("image refused: %s", str(exc)[:300])
            return images_refused(exc)

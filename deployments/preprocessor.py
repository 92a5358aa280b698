"""Preprocessor deployment: the CPU-heavy image tier, autoscaled on its own, with its options beside it.

Its work comes from the engine clients, over the preprocessing link
(`mmserve.transit.preprocessing_server`): each attaches with one long-lived Serve call
(`subscribe`), then sends jobs to this replica's inbox; each answer's pixels are written once into
Ray's object store (`pixel_store.py`), where the engine client maps them. No Ray call per image
request. The replica admits, queues and refuses its jobs itself (`replica_admission.py`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from mmserve.fetch import FetchPolicy
from mmserve.multimodal import ImageBatchRequest, ProcessedImages, load_image_family
from mmserve.multimodal.errors import ImageInputError, PreprocessorBusyError
from mmserve.multimodal.preprocessor import ImagePreprocessor, PreprocessorLimits
from mmserve.openai.body_memory import HeapTrimmer, map_large_blocks_separately
from mmserve.transit.preprocessing_link import PreprocessorHello
from mmserve.transit.preprocessing_server import PreprocessingServer
from mmserve.transit.refusals import Refusal, refusal_of
from mmserve.transit.replica_admission import ReplicaAdmission
from mmserve.vision import resize_path, warm_up_resize

from .caller_watch import HeldCalls
from .pixel_store import RayPixelStore
from .preprocessor_autoscaling import PREPROCESSOR_REQUESTS_METRIC, preprocessor_load_policy
from .ray_node import node_ip, replica_ids
from .replica_env import PIXEL_REPLICA_ENV, runtime_env
from .replica_logs import log_package_to_replica
from .replica_router import NamedReplicaRouter

logger = logging.getLogger("ray.serve")

# Engine clients attached to one replica at most (each holds one `subscribe` call open there).
ATTACHMENTS_PER_REPLICA = 1024


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
    # Image requests worked on at once, and waiting beyond them (`preprocessor.max_ongoing_requests`,
    # `preprocessor.max_queued_requests`): enforced by the replica (`ReplicaAdmission`).
    max_ongoing_requests: int
    max_queued_requests: int


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
    # Extra Ray resources per replica (where it may run).
    resources: dict[str, float]

    def options(self) -> dict[str, Any]:
        """`PreprocessorDeployment.options(...)` for this scaling. The replica admits its image
        requests itself (`PreprocessorSettings.max_ongoing_requests`); Serve's own limit only has to
        leave room for the engine clients' attachments."""
        return {
            "ray_actor_options": {
                "num_cpus": self.num_cpus, "resources": dict(self.resources), "runtime_env": runtime_env(PIXEL_REPLICA_ENV),
            },
            "max_ongoing_requests": ATTACHMENTS_PER_REPLICA,
            "autoscaling_config": AutoscalingConfig(
                min_replicas=self.min_replicas,
                max_replicas=self.max_replicas,
                target_ongoing_requests=self.target_ongoing_requests,
                upscale_delay_s=self.upscale_delay_s,
                downscale_delay_s=self.downscale_delay_s,
                look_back_period_s=self.look_back_period_s,
                metrics_interval_s=min(1.0, self.look_back_period_s / 2),
                policy=AutoscalingPolicy(policy_function=preprocessor_load_policy),
            ),
            "request_router_config": RequestRouterConfig(request_router_class=NamedReplicaRouter),
        }


def build_preprocessor(settings: PreprocessorSettings) -> ImagePreprocessor:
    family = load_image_family(settings.model_dir)
    if family is None:
        raise ValueError(f"{settings.model_dir} is not a vision model this gateway can preprocess for")
    return ImagePreprocessor(
        family, settings.fetch, settings.limits, cache_bytes=settings.cache_bytes, pixel_threads=settings.pixel_threads
    )


class WrongReplicaError(RuntimeError):
    """An attachment meant for another replica, which was stopped meanwhile (`replica_router.py`)."""


# No access line per call: each is one image request, which the ingress's access line records.
@serve.deployment(name="Preprocessor", logging_config={"enable_access_log": False})
class PreprocessorDeployment:
    def __init__(self, settings: PreprocessorSettings) -> None:
        log_package_to_replica()
        self.preprocessor = build_preprocessor(settings)
        # Decoded pixels in blocks of their own, unmapped when freed; and what the decoding threads'
        # arenas keep all the same given back once the replica is idle (`_answer`).
        map_large_blocks_separately()
        self.heap_trimmer = HeapTrimmer()
        self.admission = ReplicaAdmission(settings.max_ongoing_requests, settings.max_queued_requests)
        self.link = PreprocessingServer(self._answer, node_ip(), RayPixelStore())
        self.replica = replica_ids()[1]
        self._attachments = HeldCalls("ending its attachment and cancelling its jobs")
        warm_up_resize()  # compiling the resize takes seconds (less from numba's cache): now, not in a request
        logger.info(
            "preprocessor for %s images (pixel mode %s; image resize path: %s; %d pixel thread(s))",
            self.preprocessor.family.name, settings.pixel_mode, resize_path(), settings.pixel_threads,
        )

    async def subscribe(self, reply_to: str, replica: str | None = None, caller: str = "") -> AsyncIterator[PreprocessorHello]:
        """An engine client attaches for as long as this call lasts: it learns this replica's inbox
        (the one item), then sends jobs there, answered at its inbox `reply_to`. The call ends when
        the engine client ends it, or when the engine client, `caller` (its actor's name), died."""
        if replica and self.replica and replica != self.replica:
            raise WrongReplicaError(f"this preprocessor replica is {self.replica}, not {replica}")
        self.link.attach(reply_to)
        try:
            yield PreprocessorHello(self.link.address, self.replica)
            await self._attachments.until_gone(caller)
        finally:
            self.link.detach(reply_to)

    def pid(self) -> int:
        return os.getpid()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric (`preprocessor_autoscaling.py`)."""
        return {PREPROCESSOR_REQUESTS_METRIC: float(self.admission.load)}

    async def _answer(self, request: ImageBatchRequest) -> ProcessedImages | Refusal:
        """A refusal is an answer, not a failure: one INFO line here, a 400, 413 or 503 for the client."""
        try:
            async with self.admission.admitted():
                return await self.preprocessor.process(request)
        except (ImageInputError, PreprocessorBusyError) as exc:
            logger.info("image refused: %s", str(exc)[:300])
            return refusal_of(exc)
        finally:
            if self.admission.load == 0:
                self.heap_trimmer.request()

    async def __del__(self) -> None:
        self.link.close()

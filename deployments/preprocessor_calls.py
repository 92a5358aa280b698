"""Calls to the preprocessor deployment: from the ingress (a response it hands on unawaited) and from an engine client (which awaits the pixels itself).

Either way the call goes by reference, so the preprocessor's answer (`ProcessedImages`, numpy
arrays inside) is written once to the Ray object store and read zero-copy where it is resolved,
the engine client; and data URIs travel inside the call, cut into pieces (`inline_args.py`).
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from mmserve.multimodal import ImageBatchRequest, ImagesRefused, ProcessedImages
from mmserve.protocol import PreprocessorName

from .inline_args import cut_payloads
from .ray_errors import describe, innermost_cause

logger = logging.getLogger("ray.serve")

# Tries per request when the preprocessor replica doing it dies (preprocessing has no side effects).
PREPROCESSING_TRIES = 2
# What the client is told when Serve's queue for the preprocessor is full (whichever side called it).
QUEUE_FULL_MESSAGE = "the image preprocessing queue is full; retry shortly"


class HandlePreprocessing:
    """The preprocessor through its deployment's handle (`mmserve.openai.pending_images.Preprocessing`)."""

    def __init__(self, handle: DeploymentHandle, version: str = "") -> None:
        # By reference, whatever Ray's defaults (RAY_SERVE_THROUGHPUT_OPTIMIZED makes calls by value).
        self.handle = handle.options(_by_reference=True)
        self.name = PreprocessorName(handle.app_name, handle.deployment_name, version)

    def process(self, request: ImageBatchRequest) -> DeploymentResponse:
        """Unawaited: resolved where the pixels are needed (by Ray, when the response is an argument
        of the engine client's `add`; by `PreprocessorCalls`)."""
        cut = cut_payloads(request.urls)
        if cut is None:
            return self.handle.process.remote(request)
        counts, pieces = cut
        return self.handle.process.remote(msgspec.structs.replace(request, urls=[]), counts, *pieces)


class PreprocessorCalls:
    """An engine client's calls to the preprocessors its callers name (`ImageRequest.preprocessor`):
    the processed images, or why there are none, as the preprocessor itself answers a refusal
    (`ImagesRefused`); a replica that dies under the call is tried again once, a full queue or a
    second loss is "busy" (the client retries shortly)."""

    def __init__(self) -> None:
        self._handles: dict[PreprocessorName, HandlePreprocessing] = {}

    def _handle(self, name: PreprocessorName) -> HandlePreprocessing:
        handle = self._handles.get(name)
        if handle is None:
            handle = self._handles[name] = HandlePreprocessing(
                serve.get_deployment_handle(name.deployment, app_name=name.app), name.version
            )
        return handle

    async def process(self, request: ImageBatchRequest, name: PreprocessorName) -> ProcessedImages | ImagesRefused:
        handle = self._handle(name)
        for attempt in range(1, PREPROCESSING_TRIES + 1):
            response = handle.process(request)
            try:
                return await response
            except asyncio.CancelledError:
                response.cancel()  # (awaiting a Serve response stops waiting; this stops the call)
                raise
            except Exception as exc:
                inner = innermost_cause(exc)
                if isinstance(inner, BackPressureError):
                    return ImagesRefused(QUEUE_FULL_MESSAGE, kind="busy", retry_after_s=1)
                if not isinstance(inner, (RayError, RayServeException)):
                    raise inner from None  # the preprocessor's own bug, not a lost replica
                why = describe(inner)
                if attempt == PREPROCESSING_TRIES:
                    return ImagesRefused(f"image preprocessing failed: {why}; retry shortly", kind="busy", retry_after_s=1)
                logger.warning("image preprocessing failed (%s): trying once more", why)
        raise AssertionError("unreachable")

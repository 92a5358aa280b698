"""Calls to the preprocessor deployment: from the ingress (a response it hands on unawaited) and from an engine client (which awaits the pixels itself).

An engine client sends its link requests' images over the preprocessing link (`PreprocessorLinks`,
`mmserve.multimodal.preprocessing_client`): no Ray call per image request, the pixels back as ZMQ
frames. A Serve call remains for the rest: the ingress's requests sent as Ray calls, and an engine
client's requests before it is attached to any replica. It goes by reference, so the answer
(`ProcessedImages`, numpy arrays inside) is written once to the Ray object store and read zero-copy
where it is resolved, the engine client; data URIs travel inside the call, cut into pieces
(`inline_args.py`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable

import msgspec
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from mmserve.multimodal import ImageBatchRequest, ImagesRefused, ProcessedImages
from mmserve.multimodal.preprocessing_client import NoReplicaAttached, PreprocessingInbox, PreprocessorReplicas, ReplicaLost
from mmserve.multimodal.replica_admission import QUEUE_FULL_MESSAGE
from mmserve.protocol import PreprocessorName

from .engine_pool_members import pool_members, watch_members
from .inline_args import cut_payloads
from .pixel_store import RayPixelStore
from .ray_errors import describe, innermost_cause
from .ray_node import replica_ids

logger = logging.getLogger("ray.serve")

# Tries per request when the preprocessor replica doing it dies (preprocessing has no side effects).
PREPROCESSING_TRIES = 2


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


class PreprocessorLinks:
    """One preprocessor deployment as an engine client reaches it over the preprocessing link: an
    attachment to each of its replicas (a `subscribe` call held open there), made and ended as this
    process's Serve router hears the replica list change (`replica_router.py`)."""

    def __init__(self, name: PreprocessorName, inbox: PreprocessingInbox, handle: DeploymentHandle) -> None:
        # Options make the handle start its router now (shared with `handle`'s other options: one
        # router per deployment in this process, each pushing Serve's metrics every second), which
        # then hears of the replicas.
        self.handle = handle.options(stream=True)
        self.name = name
        self._inbox = inbox
        self.replicas = PreprocessorReplicas(inbox, self._end_attachment)
        # This engine client's actor name: a replica ends the attachment when that actor is gone.
        self._caller = replica_ids()[0]
        self._attachments: dict[str, asyncio.Task[None]] = {}
        self._members: tuple[str, ...] | None = None
        loop = asyncio.get_running_loop()
        watch_members(name.app, name.deployment, lambda: _call_soon(loop, self.refresh))
        self.refresh()

    def refresh(self) -> None:
        """Attach to replicas newly listed; let the ones no longer listed go once their jobs are done."""
        members = pool_members(self.name.app, self.name.deployment)
        if members is self._members:
            return
        self._members = members
        listed = set(members or ())
        for replica in listed - self._attachments.keys():
            self._attachments[replica] = asyncio.get_running_loop().create_task(
                self._attach(replica), name="preprocessor-attachment", context=contextvars.Context()
            )
        for replica in self._attachments.keys() - listed:
            if replica in self.replicas:
                self.replicas.leave(replica)
            else:
                self._end_attachment(replica)

    def close(self) -> None:
        """End every attachment (Ray would not end these calls when this process exits)."""
        self.replicas.close()
        for replica in list(self._attachments):
            self._end_attachment(replica)

    def _end_attachment(self, replica: str) -> None:
        if (attachment := self._attachments.pop(replica, None)) is not None:
            attachment.cancel()

    async def _attach(self, replica: str) -> None:
        stream = self.handle.subscribe.remote(self._inbox.address, replica=replica, caller=self._caller)
        try:
            async for hello in stream:
                if hello.replica == replica:
                    self.replicas.attach(replica, hello.inbox)
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as exc:  # the replica died or was stopped: its jobs are tried elsewhere
            logger.info("engine client: attachment to preprocessor replica %s ended: %s", replica, describe(innermost_cause(exc)))
        finally:
            self.replicas.lost(replica)
            if self._attachments.get(replica) is asyncio.current_task():
                del self._attachments[replica]


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:  # the loop is closed: the replica is stopping
        pass


class PreprocessorCalls:
    """An engine client's calls to the preprocessors its callers name (`ImageRequest.preprocessor`):
    the processed images, or why there are none, as the preprocessor itself answers a refusal
    (`ImagesRefused`). Over the preprocessing link (`PreprocessorLinks`) when `host` is given and
    a replica is attached, else as a Serve call; a replica that dies under the call is tried again
    once, a full queue or a second loss is "busy" (the client retries shortly)."""

    def __init__(self, host: str | None = None) -> None:
        self._host = host
        self._inbox: PreprocessingInbox | None = None
        # By application and deployment: a new version of its settings is served by the same replicas' successors.
        self._links: dict[tuple[str, str], PreprocessorLinks] = {}
        self._handles: dict[PreprocessorName, HandlePreprocessing] = {}
        # One Serve handle per deployment, both ways derived from it: one router between them.
        self._deployment_handles: dict[tuple[str, str], DeploymentHandle] = {}
        # Requests answered over the preprocessing link (`EngineInfo.link_images_over_preprocessing_link`).
        self.over_link = 0

    async def process(self, request: ImageBatchRequest, name: PreprocessorName) -> ProcessedImages | ImagesRefused:
        links = self._links_of(name)
        for attempt in range(1, PREPROCESSING_TRIES + 1):
            if links is None:
                break
            try:
                answer = await links.replicas.process(request)
                self.over_link += 1
                return answer
            except NoReplicaAttached:
                break
            except ReplicaLost as exc:
                if attempt == PREPROCESSING_TRIES:
                    return ImagesRefused(f"image preprocessing failed: {exc}; retry shortly", kind="busy", retry_after_s=1)
                logger.warning("image preprocessing failed (%s): trying once more", exc)
        return await self._call(request, name)

    def close(self) -> None:
        for links in self._links.values():
            links.close()
        if self._inbox is not None:
            self._inbox.close()

    def _links_of(self, name: PreprocessorName) -> PreprocessorLinks | None:
        if self._host is None:
            return None
        links = self._links.get((name.app, name.deployment))
        if links is None:
            if self._inbox is None:
                self._inbox = PreprocessingInbox(self._host, RayPixelStore())
            links = self._links[(name.app, name.deployment)] = PreprocessorLinks(name, self._inbox, self._deployment_handle(name))
        return links

    def _handle(self, name: PreprocessorName) -> HandlePreprocessing:
        handle = self._handles.get(name)
        if handle is None:
            handle = self._handles[name] = HandlePreprocessing(self._deployment_handle(name), name.version)
        return handle

    def _deployment_handle(self, name: PreprocessorName) -> DeploymentHandle:
        key = (name.app, name.deployment)
        if key not in self._deployment_handles:
            self._deployment_handles[key] = serve.get_deployment_handle(name.deployment, app_name=name.app)
        return self._deployment_handles[key]

    async def _call(self, request: ImageBatchRequest, name: PreprocessorName) -> ProcessedImages | ImagesRefused:
        """As a Serve call (no replica attached yet)."""
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

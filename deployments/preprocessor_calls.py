"""An engine client's calls to the preprocessor deployments its callers name, over the preprocessing link.

`PreprocessorLinks` attaches the engine client to each replica of one deployment (a Serve call held
open there: the replica's inbox, and its end says the replica is gone), as Serve's replica list
changes; `PreprocessorCalls` sends each request's images to an attached replica as one ZMQ message
and reads the answer, its pixels mapped from the object store
(`mmserve.transit.preprocessing_client`). No Ray call per image request.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable

from ray import serve
from ray.serve.handle import DeploymentHandle

from mmserve.multimodal import ImageBatchRequest, ProcessedImages
from mmserve.transit.engine_link import PreprocessorName
from mmserve.transit.preprocessing_client import PreprocessingInbox, PreprocessorReplicas
from mmserve.transit.preprocessing_link import PixelStore
from mmserve.transit.refusals import LinkLost, Refusal

from .engine_pool_members import pool_members, watch_members
from .ray_errors import describe, innermost_cause
from .ray_node import replica_ids

logger = logging.getLogger("ray.serve")

# Tries per request when the preprocessor replica doing it is lost (preprocessing has no side effects).
PREPROCESSING_TRIES = 2


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
    the processed images, or why there are none, as the preprocessor itself answers a refusal. A
    request waits up to `attach_timeout_s` for a replica to be attached ("busy" if none is); a job
    lost on the way, or with its replica, is tried again once, and refused "lost" if lost again.
    Answers arrive at one inbox bound on `host`, their pixels read from `store`."""

    def __init__(self, host: str, store: PixelStore, attach_timeout_s: float) -> None:
        self._host = host
        self._store = store
        self._attach_timeout_s = attach_timeout_s
        self._inbox: PreprocessingInbox | None = None
        # By application and deployment: a new version of its settings is served by the same replicas' successors.
        self._links: dict[tuple[str, str], PreprocessorLinks] = {}
        # Jobs sent (`EngineInfo.preprocessing_jobs`).
        self.jobs = 0

    async def process(self, request: ImageBatchRequest, name: PreprocessorName) -> ProcessedImages | Refusal:
        replicas = self._links_of(name).replicas
        for attempt in range(1, PREPROCESSING_TRIES + 1):
            self.jobs += 1
            try:
                return await replicas.process(request, self._attach_timeout_s)
            except LinkLost as exc:
                if attempt == PREPROCESSING_TRIES:
                    return Refusal("lost", f"image preprocessing failed: {exc}; retry shortly", retry_after_s=1)
                logger.warning("image preprocessing failed (%s): trying once more", exc)
        raise AssertionError("unreachable")

    def close(self) -> None:
        for links in self._links.values():
            links.close()
        if self._inbox is not None:
            self._inbox.close()

    def _links_of(self, name: PreprocessorName) -> PreprocessorLinks:
        links = self._links.get((name.app, name.deployment))
        if links is None:
            if self._inbox is None:
                self._inbox = PreprocessingInbox(self._host, self._store)
            handle = serve.get_deployment_handle(name.deployment, app_name=name.app)
            links = self._links[(name.app, name.deployment)] = PreprocessorLinks(name, self._inbox, handle)
        return links

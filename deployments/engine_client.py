"""Engine-client deployment: one replica per vLLM engine, a thin shell over `EngineClient`.

The replica binds the engine's ZMQ sockets and stays bound for its whole life, so the engine
(a `vllm serve --headless` process, or the built-in engine this replica starts itself) can
connect whenever it is ready. An engine that dies is replaced in place: a new engine client
waits on the same addresses (`EngineClientServer`); `check_health` fails only if that stops.

Requests arrive one Ray call each (`add`); their outputs leave on one stream per ingress replica
(`subscribe`), merged per engine step, never one Ray item per token per request.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from ray import serve

from mmserve.engine.outputs import CallerChannel
from mmserve.engine.frame_diagnostics import FrameTrace
from mmserve.engine.output_link import OutputOutbox
from mmserve.multimodal import ImagesRefused, ProcessedImages
from mmserve.protocol import Admission, EngineInfo, OutputBatch, RequestFailed, RequestRefused, encode
from mmserve.wire import EngineCoreRequest

from .caller_watch import CallerWatch
from .engine_client_server import EngineClientServer, EngineClientSettings
from .replica_logs import log_package_to_replica

logger = logging.getLogger("ray.serve")


def _replica_name() -> str:
    try:
        return serve.get_replica_context().replica_id.to_full_id_str()
    except Exception:  # not in a replica (tests)
        return ""


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


@serve.deployment(
    num_replicas=1,
    # Requests are cheap here (bytes in, tokens out); the engine's own max_num_seqs and the
    # ingress's admission limits bound the real concurrency.
    max_ongoing_requests=4096,
    ray_actor_options={"num_cpus": 0},
    health_check_period_s=2,
    health_check_timeout_s=10,
)
class EngineClientDeployment:
    """Each ingress replica (a caller) holds one long-lived `subscribe` call here, beside which the
    outputs of all its requests travel over ZMQ, merged per engine step (`CallerChannel`); `add`
    sends one request and answers at once. So Ray carries one call per request, and no item per
    token (see `mmserve.protocol`)."""

    async def __init__(self, settings: EngineClientSettings) -> None:
        log_package_to_replica()
        self.server = EngineClientServer(settings)
        self.replica = _replica_name()
        self._channels: dict[str, CallerChannel] = {}
        self._subscribers: dict[str, asyncio.Task[Any]] = {}
        self._callers = CallerWatch(self._caller_gone)
        await self.server.start()

    def _channel(self, caller: str) -> CallerChannel:
        channel = self._channels.get(caller)
        if channel is None:
            channel = self._channels[caller] = CallerChannel()
            # A caller that dies takes its requests with it (see CallerWatch).
            self._callers.watch(caller)
        return channel

    async def subscribe(self, caller: str, inbox: str) -> AsyncIterator[bytes]:
        """The caller's output stream: one `OutputBatch` naming this replica, here; then, over ZMQ
        to the caller's `inbox` (see `mmserve.engine.output_link`), batches of its requests' outputs
        and failures, each as soon as the previous one is on its way. This call stays open as
        long as the link: it ends (and aborts the caller's requests) when the caller cancels it or
        dies."""
        channel = self._channel(caller)
        task = asyncio.current_task()
        assert task is not None
        if (previous := self._subscribers.get(caller)) is not None:
            previous.cancel()  # one stream per caller: the newest
        self._subscribers[caller] = task
        outbox = OutputOutbox(inbox)
        try:
            yield encode(OutputBatch(replica=self.replica))
            while True:
                outputs, failures = await channel.take()
                await outbox.send(encode(OutputBatch(outputs, [RequestFailed(rid, why) for rid, why in failures])))
        finally:
            outbox.close()
            if self._subscribers.get(caller) is task:
                del self._subscribers[caller]
                await self._drop_caller(caller)

    async def add(
        self, request: EngineCoreRequest, images: ProcessedImages | ImagesRefused | None = None, caller: str = ""
    ) -> bytes:
        """Send one request; its outputs travel on the caller's `subscribe` stream. Answers an
        encoded `Admission` (with this replica's name, which the caller checks its stream against)."""
        channel = self._channel(caller)
        if not channel.track(request.request_id):
            return encode(Admission(refused=RequestRefused("cancelled", "the caller aborted the request before it arrived")))
        try:
            admission = await self.server.add(request, images, channel)
        except BaseException:
            channel.untrack(request.request_id)
            raise
        if admission.refused is not None:
            channel.untrack(request.request_id)
        elif self._channels.get(caller) is not channel:
            # The caller went away while this request was being sent.
            await self.server.client.abort_quietly([request.request_id])
        return encode(msgspec.structs.replace(admission, replica=self.replica))

    async def abort(self, request_ids: list[str], caller: str = "") -> None:
        """The caller gave these requests up (its client left, a stop string matched)."""
        if (channel := self._channels.get(caller)) is not None:
            channel.aborted(request_ids)
        await self.server.client.abort_quietly(request_ids)

    async def _drop_caller(self, caller: str) -> None:
        self._callers.unwatch(caller)
        channel = self._channels.pop(caller, None)
        if channel is not None and channel.request_ids:
            await self.server.client.abort_quietly(list(channel.request_ids))

    async def _caller_gone(self, caller: str) -> None:
        if (subscriber := self._subscribers.get(caller)) is not None:
            subscriber.cancel()  # its cleanup drops the caller
        else:
            await self._drop_caller(caller)

    async def info(self) -> EngineInfo:
        return await self.server.info()

    async def call_utility(self, method: str, *args: Any) -> Any:
        return await self.server.call_utility(method, *args)

    def check_health(self) -> None:
        self.server.check_health()

    async def launcher_status(self) -> dict[str, Any] | None:
        """The launched engine's process tree, starts and exits, and restarts asked for here
        (None: the engine was not started by this application)."""
        if self.server.launcher is None:
            return None
        status = await self.server.launcher.status.remote()
        return {
            **status, "restarts_requested": self.server.engine_restarts, "engine_client_node_id": _node_id(),
            "launcher_name": self.server.launcher_name,
        }

    def frame_traces(self) -> list[FrameTrace]:
        return list(self.server.client.frame_traces)

    def pid(self) -> int:
        return os.getpid()

    async def __del__(self) -> None:
        await self.server.shutdown()

"""Engine-client deployment: one replica per vLLM engine, a thin shell over `EngineClient`.

One deployment per engine (engines started elsewhere, or a fixed number), or one deployment whose
replicas Serve scales, an engine each (an engine pool: `engine_pool.py`); calls to a pool name the
replica they are for (`engine`).

The replica binds the engine's ZMQ sockets and stays bound for its whole life, so the engine
(a `vllm serve --headless` process, or the built-in engine this replica starts itself) can
connect whenever it is ready. An engine that dies is replaced in place: a new engine client
waits on the same addresses (`EngineClientServer`); `check_health` fails only if that stops.

Each ingress replica holds one Ray call open here (`subscribe`); beside it, over ZMQ, its
requests and aborts arrive at this replica's inbox, and their answers and outputs leave for the
caller's inbox, merged per engine step (`mmserve.transit.sockets`): Ray carries nothing from the
ingress per request and nothing per token. For an image request this replica has the preprocessor
the request names process its images, over the preprocessing link (`link_images.py`): the pixels
come through Ray's object store and go on to the engine uncopied.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from ray import serve

from mmserve.engine import EngineDeadError, EngineNotReadyError
from mmserve.engine.outputs import CallerChannel
from mmserve.engine.frame_diagnostics import FrameTrace
from mmserve.transit.sockets import Arrivals, LinkInbox, LinkOutbox
from mmserve.transit.engine_link import (
    AbortRequests, AddAnswer, Admission, EngineInfo, ImageRequest, OutputBatch, Probe, RequestFailed, TextRequest,
    decode_link_request, encode, unreadable_request_sender,
)

from mmserve.transit.refusals import Refusal

from .caller_watch import CallerWatch
from .engine_client_server import EngineClientServer, EngineClientSettings
from .engine_pool_autoscaling import ENGINE_KV_CACHE_USAGE_METRIC, ENGINE_REQUESTS_METRIC
from .link_images import LinkImages
from .ray_node import node_ip, replica_ids
from .raylet_watch import RayletWatch
from .replica_logs import log_package_to_replica

logger = logging.getLogger("ray.serve")

# After its node is lost, how long this replica has to tell its callers before it exits.
NODE_LOST_EXIT_S = 1.0


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()



@serve.deployment(
    num_replicas=1,
    # Its Serve calls are the callers' subscriptions (one per ingress replica) and control calls;
    # requests arrive over ZMQ, bounded by the engine client's `max_in_flight`.
    max_ongoing_requests=4096,
    ray_actor_options={"num_cpus": 0},
    health_check_period_s=2,
    health_check_timeout_s=10,
    # Its calls come from the ingress (`subscribe`, `info`): a line per call here would be written,
    # shipped to the driver and printed for each.
    logging_config={"enable_access_log": False},
)
class EngineClientDeployment:
    """Each ingress replica (a caller) holds one long-lived `subscribe` call here, beside which the
    outputs of all its requests travel over ZMQ, merged per engine step (`CallerChannel`), and its
    requests and aborts arrive over ZMQ (`_read_link`; see `mmserve.transit.engine_link`)."""

    async def __init__(self, settings: EngineClientSettings) -> None:
        log_package_to_replica()
        self.server = EngineClientServer(settings)
        # Its full id (in admissions) and unique id (the `engine` calls to a pool name).
        self.replica, self.engine_id = replica_ids()
        self._channels: dict[str, CallerChannel[AddAnswer]] = {}
        self._subscribers: dict[str, asyncio.Task[Any]] = {}
        self._callers = CallerWatch(self._caller_gone)
        await self.server.start()
        loop = asyncio.get_running_loop()
        RayletWatch(lambda: self._node_lost_from_thread(loop)).start()
        self._inbox = LinkInbox(node_ip(), name="engine-client-inbox")
        self._link_tasks: set[asyncio.Task[None]] = set()
        # The numbers of each caller's messages (a loss found by them), and the callers to be told of one.
        self._arrivals = Arrivals()
        self._lost: set[str] = set()
        self._requests_received = 0
        self._image_requests_received = 0
        self._images = LinkImages(
            lambda mm_hashes: self.server.client.adds.holds(mm_hashes), node_ip(), settings.engine_wait_timeout_s
        )
        self._link_reader = loop.create_task(self._read_link(), name="engine-client-inbox")

    def _channel(self, caller: str) -> CallerChannel[AddAnswer]:
        channel = self._channels.get(caller)
        if channel is None:
            channel = self._channels[caller] = CallerChannel()
            # A caller that dies takes its requests with it (see CallerWatch).
            self._callers.watch(caller)
        return channel

    def _node_lost_from_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        """This node's raylet is gone: Ray would end this process seconds later, its callers learning
        only then. Fail every request at once over the callers' links, then exit; if the loop cannot
        do it within `NODE_LOST_EXIT_S`, exit anyway."""
        loop.call_soon_threadsafe(lambda: loop.create_task(self._node_lost(), name="node-lost"))
        time.sleep(NODE_LOST_EXIT_S)
        os._exit(1)

    async def _node_lost(self) -> None:
        reason = "the engine's node left the Ray cluster (its raylet is gone)"
        logger.error("engine client: %s; failing its %d requests and exiting", reason, self.server.client.num_in_flight)
        await self.server.node_lost(reason)
        # Each caller's `subscribe` takes its failures and hands them to ZMQ, whose I/O thread then
        # writes them out: both before the process goes.
        for _ in range(50):  # (a caller with no stream open takes nothing: the thread's exit ends this)
            if not any(channel.pending for channel in self._channels.values()):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        os._exit(1)

    def _mine(self, engine: str) -> bool:
        """Whether a call naming `engine` (a pool replica's unique id; "" names none) is for this
        replica: a call for a pool replica that was stopped reaches another (`deployments/engine_pool.py`)."""
        return not engine or engine == self.engine_id

    async def subscribe(self, caller: str, inbox: str, engine: str = "") -> AsyncIterator[bytes]:
        """The caller's output stream: one `OutputBatch` naming this replica, here; then, over ZMQ
        to the caller's `inbox` (see `mmserve.transit.sockets`), batches of its requests' outputs
        and failures, each as soon as the previous one is on its way. This call stays open as
        long as the link: it ends (and aborts the caller's requests) when the caller cancels it or
        dies. A stream meant for another replica ends at once."""
        if not self._mine(engine):
            return
        channel = self._channel(caller)
        task = asyncio.current_task()
        assert task is not None
        if (previous := self._subscribers.get(caller)) is not None:
            previous.cancel()  # one stream per caller: the newest
        self._subscribers[caller] = task
        outbox = LinkOutbox(inbox)
        try:
            yield encode(OutputBatch(replica=self.replica, requests_address=self._inbox.address))
            while True:
                outputs, failures, answers = await channel.take()
                failed = [RequestFailed(rid, why) for rid, why in failures]
                lost = caller in self._lost
                self._lost.discard(caller)
                outbox.send(OutputBatch(outputs, failed, answers, lost=lost), encode)
        finally:
            outbox.close()
            if self._subscribers.get(caller) is task:
                del self._subscribers[caller]
                await self._drop_caller(caller)

    async def _add(self, message: TextRequest | ImageRequest) -> Admission:
        """Send the request to the engine, an image request's images processed first (the request
        counts as the caller's meanwhile: an abort, or the caller's end, cancels the processing and
        keeps it from the engine)."""
        caller, request = message.caller, message.request
        channel = self._channel(caller)
        request_id = request.request_id
        if not channel.track(request_id):
            return Admission(refused=Refusal("cancelled", "the caller aborted the request before it arrived"))
        try:
            images = reprocess = None
            if isinstance(message, ImageRequest):
                refused = self.server.overloaded()  # (before the images' work)
                if refused is None:
                    images = await self._images.process(message)
                    if images is None or self._channels.get(caller) is not channel or request_id not in channel.request_ids:
                        refused = Refusal("cancelled", "the caller aborted the request while its images were processed")
                if refused is not None:
                    channel.untrack(request_id)
                    return Admission(refused=refused)
                reprocess = self._images.reprocess(message)
            admission = await self.server.add(request, images, channel, reprocess)
        except BaseException:
            channel.untrack(request_id)
            raise
        if admission.refused is not None:
            channel.untrack(request_id)
        elif self._channels.get(caller) is not channel or request_id not in channel.request_ids:
            # The caller went away, or aborted the request, while it was being sent (an abort of a
            # request that finished meanwhile is a no-op).
            await self.server.client.abort_quietly([request_id])
        return admission

    async def _abort(self, message: AbortRequests) -> None:
        """The caller gave these requests up (its client left, a stop string matched)."""
        if (channel := self._channels.get(message.caller)) is not None:
            channel.aborted(message.request_ids)
        for request_id in message.request_ids:
            self._images.cancel(message.caller, request_id)
        await self.server.client.abort_quietly(message.request_ids)

    async def _read_link(self) -> None:
        """Requests, aborts and probes from the callers, over ZMQ (`mmserve.transit.engine_link.LinkRequest`),
        each handled as its own task, in arrival order: an abort that follows its request finds it
        tracked (or makes the request abort itself once sent, see `_add`). A message found lost before
        one fails every request of its caller's (`_requests_lost`)."""
        while True:
            data = await self._inbox.recv()
            try:
                message = decode_link_request(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("engine client: an unreadable message on its request link (%d bytes): %s", len(data), exc)
                if (sender := unreadable_request_sender(data)) is not None and (channel := self._channels.get(sender[0])) is not None:
                    refused = Refusal("internal", f"the engine client could not read the request: {exc}")
                    channel.answer(AddAnswer(sender[1], Admission(refused=refused)))
                continue
            if self._arrivals.lost(message.caller, message):
                await self._requests_lost(message.caller)
            if isinstance(message, Probe):
                self._channel(message.caller).wake()  # (its answer: the next batch, numbered)
                continue
            if isinstance(message, AbortRequests):
                task = asyncio.get_running_loop().create_task(self._abort(message))
            else:
                self._requests_received += 1
                self._image_requests_received += isinstance(message, ImageRequest)
                task = asyncio.get_running_loop().create_task(self._add_from_link(message))
            self._link_tasks.add(task)
            task.add_done_callback(self._link_tasks.discard)

    async def _add_from_link(self, message: TextRequest | ImageRequest) -> None:
        request_id = message.request.request_id
        try:
            admission = await self._add(message)
        except EngineDeadError as exc:
            admission = Admission(refused=Refusal("dead", str(exc)))
        except EngineNotReadyError as exc:
            admission = Admission(refused=Refusal("not_ready", str(exc)))
        except Exception as exc:
            logger.exception("engine client: request %s failed", request_id)
            admission = Admission(refused=Refusal("internal", f"{type(exc).__name__}: {exc}"))
        if (channel := self._channels.get(message.caller)) is not None:
            channel.answer(AddAnswer(request_id, admission))

    async def _requests_lost(self, caller: str) -> None:
        """Messages from `caller` were lost on the way: a request, or an abort, of its may be among
        them. Every request of its here is aborted, and it is told (`OutputBatch.lost`), failing them all."""
        channel = self._channel(caller)
        request_ids = list(channel.request_ids)
        logger.warning("engine client: messages from %s were lost on the way: aborting its %d requests", caller, len(request_ids))
        channel.aborted(request_ids)
        self._images.cancel_caller(caller)
        await self.server.client.abort_quietly(request_ids)
        self._lost.add(caller)
        channel.wake()

    async def _drop_caller(self, caller: str) -> None:
        self._callers.unwatch(caller)
        self._arrivals.forget(caller)
        self._lost.discard(caller)
        self._images.cancel_caller(caller)
        channel = self._channels.pop(caller, None)
        if channel is not None and channel.request_ids:
            await self.server.client.abort_quietly(list(channel.request_ids))

    async def _caller_gone(self, caller: str) -> None:
        if (subscriber := self._subscribers.get(caller)) is not None:
            subscriber.cancel()  # its cleanup drops the caller
        else:
            await self._drop_caller(caller)

    async def info(self, engine: str = "") -> EngineInfo | None:
        """This engine's state; None if the call was meant for another (stopped) pool replica."""
        if not self._mine(engine):
            return None
        return msgspec.structs.replace(
            await self.server.info(), requests_received=self._requests_received,
            image_requests_received=self._image_requests_received, images_recalled=self._images.recalled,
            preprocessing_jobs=self._images.jobs,
        )

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (engine pools, `deployments/engine_pool_autoscaling.py`):
        the requests this engine holds, running or waiting in its scheduler, and its KV-cache usage."""
        stats = {ENGINE_REQUESTS_METRIC: float(self.server.client.num_in_flight)}
        if (scheduler := self.server.client.scheduler_stats) is not None:
            stats[ENGINE_KV_CACHE_USAGE_METRIC] = float(scheduler.kv_cache_usage)
        return stats

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
        self._link_reader.cancel()
        self._inbox.close()
        self._images.close()
        await self.server.shutdown()

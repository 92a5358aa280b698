"""One engine client as an ingress replica reaches it: a Serve handle for its control calls, ZMQ links for its requests and outputs, Ray's failures typed.

`HandleEngineConnection` adapts an engine client's `DeploymentHandle` (its `subscribe` and `info`
calls) and the links its subscription opens (`mmserve.transit.sockets`) to
`mmserve.transit.router.EngineConnection`; `HandleEngineCall` is one request on it. Where the
engines come from (a deployment, a pool, engine applications) is `deployments/router.py`'s business.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from ray.serve.handle import DeploymentHandle, DeploymentResponse

from mmserve.transit.engine_link import AbortRequests, EngineEvent, EngineInfo, Probe, TextRequest, decode_output_batch, encode
from mmserve.transit.engine_outputs import OutputDemux, RequestOutputs
from mmserve.transit.pending_images import PendingImages
from mmserve.transit.refusals import GatewayBusyError, LinkLost
from mmserve.transit.sockets import LINK_PROBE_S, LinkInbox, LinkOutbox
from mmserve.wire import EngineCoreRequest

from .ray_errors import describe, innermost_cause
from .ray_node import node_ip

logger = logging.getLogger("ray.serve")

# After the output stream broke: wait this long before subscribing again (the engine client's
# replica is being replaced; Serve queues the call until the new one runs).
RESUBSCRIBE_DELAY_S = 0.2


class HandleEngineConnection:
    """One engine client through its deployment's handle: one long-lived `subscribe` call, beside
    which outputs and answers come back over ZMQ to this replica's inbox, read by a background task
    and handed to each request by `OutputDemux`; requests and aborts go over ZMQ to the engine
    client's inbox, which the subscription names (`link`; see `mmserve.transit.engine_link`). A request waits
    up to `link_timeout_s` for the link to open (a 503 after). For an engine pool, `engine` names
    the replica the calls are for (`deployments/engine_pool.py`)."""

    def __init__(
        self, handle: DeploymentHandle, caller: str | None, link_timeout_s: float, engine: str = "",
        gone: asyncio.Event | None = None,
    ) -> None:
        self.handle = handle
        # This replica's actor name: engine clients abort our requests if we die.
        self.caller = caller or ""
        self.link_timeout_s = link_timeout_s
        self.engine = engine
        # Set once this engine's application is being deleted: Serve takes its replica out of the
        # routers at once, so a call to it would wait for a replica forever (see `unless_gone`).
        self.gone = gone
        self.demux = OutputDemux()
        # To the engine-client replica whose stream is being read (None: none yet, or it ended).
        self.link: LinkOutbox | None = None
        self._link_open = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    async def info(self) -> EngineInfo | None:
        return await self.unless_gone(_own_request(self.handle.info, engine=self.engine))

    async def unless_gone(self, response: DeploymentResponse | Awaitable[Any]) -> Any:
        """`response`'s result; given up (LinkLost) once this engine is found gone."""
        if self.gone is None:
            return await response
        call = asyncio.ensure_future(response)
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
            if call.done():
                return call.result()
            if isinstance(response, DeploymentResponse):
                response.cancel()
            raise LinkLost("its engine application is being deleted")
        finally:
            # Given up, answered, or this caller was cancelled: nothing awaits either any more.
            call.cancel()
            gone.cancel()

    def generate(self, request: EngineCoreRequest, images: PendingImages | None) -> "HandleEngineCall":
        if self._reader is None or self._reader.done():
            # Outside the request's context: Serve cancels the handle calls a request made when
            # that request is cancelled (its client left), and this stream serves every request.
            self._reader = asyncio.get_running_loop().create_task(
                self._read_outputs(), name="engine-outputs", context=contextvars.Context()
            )
        return HandleEngineCall(self, request, images)

    async def open_link(self) -> LinkOutbox:
        """The link to the engine client, once open; `GatewayBusyError` if it is not within `link_timeout_s`."""
        if self.link is None:
            try:
                await self.unless_gone(asyncio.wait_for(self._link_open.wait(), self.link_timeout_s))
            except TimeoutError:
                raise GatewayBusyError(f"the engine client was not reachable within {self.link_timeout_s:.0f} s; retry shortly") from None
        assert self.link is not None
        return self.link

    def abort(self, request_id: str) -> None:
        """Fire and forget: the request is given up here whatever the engine client answers. With
        no link open, the engine client's subscription has ended, and with it the requests it held."""
        if self.link is not None:
            self.link.send(AbortRequests(self.caller, [request_id]), encode)

    async def _read_outputs(self) -> None:
        """Follow the engine client's outputs for this replica, for the replica's life: batches
        arrive over ZMQ at this connection's inbox, while the `subscribe` call beside it says which
        engine-client replica sends them, and by ending, that it is gone; then the requests it
        carried fail and this subscribes again."""
        inbox = LinkInbox(node_ip())
        receiver = asyncio.get_running_loop().create_task(self._receive(inbox), name="engine-output-inbox")
        prober = asyncio.get_running_loop().create_task(self._probe(), name="engine-link-probe")
        try:
            while True:
                try:
                    subscription = self.handle.options(stream=True).subscribe.remote(self.caller, inbox.address, engine=self.engine)
                    async for item in subscription:
                        first = decode_output_batch(item)
                        if first.replica is not None:
                            self.demux.connected(first.replica)
                        if first.requests_address is not None:
                            self._close_link()
                            self.link = LinkOutbox(first.requests_address)
                            self._link_open.set()
                    error = LinkLost("the engine client ended its output stream")
                except asyncio.CancelledError:
                    # Closed: end the call itself too, or the engine client would count it as
                    # ongoing, and Serve would wait for it before stopping a drained replica.
                    subscription.cancel()
                    raise
                except Exception as exc:
                    error = LinkLost(describe(innermost_cause(exc)))
                self._close_link()
                if len(self.demux):
                    logger.warning("engine client output stream lost: %s", error)
                self.demux.lost(error)
                await asyncio.sleep(RESUBSCRIBE_DELAY_S)
        finally:
            self._close_link()
            receiver.cancel()
            prober.cancel()
            inbox.close()

    def _close_link(self) -> None:
        self._link_open.clear()
        if self.link is not None:
            self.link.close()
            self.link = None

    async def _probe(self) -> None:
        """With requests in flight and nothing heard for `LINK_PROBE_S`, ask the engine client for a
        batch: its number shows whether one was lost (`OutputDemux.dispatch`), and the probe's own,
        at the engine client, whether a request was."""
        while True:
            await asyncio.sleep(LINK_PROBE_S)
            if len(self.demux) and self.link is not None and time.monotonic() - self.demux.heard_at >= LINK_PROBE_S:
                self.link.send(Probe(self.caller), encode)

    async def _receive(self, inbox: LinkInbox) -> None:
        while True:
            self.demux.dispatch(decode_output_batch(await inbox.recv()))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._close_link()
        # Requests still waiting for outputs from here would wait forever.
        self.demux.lost(LinkLost("the ingress closed its connection to this engine client"))


class HandleEngineCall:
    """One request through a `HandleEngineConnection`; failures leave it typed (see `EngineConnection`)."""

    def __init__(self, connection: HandleEngineConnection, request: EngineCoreRequest, images: PendingImages | None) -> None:
        self.connection = connection
        self.request = request
        self.images = images
        # The engine client may hold the request (sent, not refused, not finished): `cancel` aborts it.
        self._held = False

    async def __aiter__(self) -> AsyncIterator[EngineEvent]:
        connection = self.connection
        request_id = self.request.request_id
        outputs = connection.demux.register(request_id)
        try:
            answer = await self._send(outputs)
            admission = answer.admission
            if admission.refused is not None:
                self._held = False  # nothing reached the engine
                yield EngineEvent(refused=admission.refused)
                return
            outputs.replica = connection.demux.replica
            if admission.accepted is not None:
                yield EngineEvent(accepted=admission.accepted)
            while self._held:
                batch = await outputs.next()
                self._held = not batch[-1].finished
                yield EngineEvent(outputs=batch)
        finally:
            connection.demux.unregister(request_id)

    async def _send(self, outputs: RequestOutputs) -> Any:
        """Send the request over the link and wait for its answer (an `AddAnswer`)."""
        connection = self.connection
        link = await connection.open_link()
        if self.images is None:
            message = TextRequest(connection.caller, self.request)
        else:
            message = self.images.message(connection.caller, self.request)
        link.send(message, encode)
        self._held = True  # until the answer says otherwise
        outputs.awaiting_answer = True
        # If its answer never comes (the stream ended, the engine is gone, or this caller was
        # cancelled), this raises with `_held` still set: `cancel` aborts it, in case the engine
        # client took it.
        return await connection.unless_gone(outputs.next_answer())

    def cancel(self) -> None:
        """Give the request up: the engine client aborts it (or refuses it if the abort overtakes it)."""
        if self._held:
            self.connection.abort(self.request.request_id)


def _own_request(method: Any, *args: Any, **kwargs: Any) -> DeploymentResponse:
    """`method.remote(*args, **kwargs)` as a Serve request of its own. Calls made while serving one
    HTTP request inherit its request id, by which Serve's router hands the replica it chose to the
    call it chose it for: an engine pool's calls, each meant for its own replica, made at once (the
    engines' states) would be handed each other's replicas."""
    return contextvars.Context().run(method.remote, *args, **kwargs)

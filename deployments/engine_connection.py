"""One engine client as an ingress replica reaches it: a Serve handle for its Ray calls, ZMQ links for its requests and outputs, Ray's failures typed.

`HandleEngineConnection` adapts an engine client's `DeploymentHandle` (and the links its
subscription opens, `mmserve.zmq_link`) to `mmserve.openai.engine_router.EngineConnection`;
`HandleEngineCall` is one request on it. Where the engines come from (a deployment, a pool, engine
applications) is `deployments/router.py`'s business.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from mmserve.engine import EngineDeadError, EngineNotReadyError
from mmserve.zmq_link import LinkInbox, LinkOutbox
from mmserve.openai.engine_outputs import OutputDemux, RequestOutputs
from mmserve.openai.engine_router import ReplicaLostError
from mmserve.openai.pending_images import PendingImages
from mmserve.protocol import (
    NOT_THIS_ENGINE, AbortRequests, AddAnswer, Admission, EngineEvent, EngineInfo, GatewayBusyError, ImageRequest,
    TextRequest, decode_admission, decode_output_batch, encode,
)
from mmserve.wire import EngineCoreRequest

from .preprocessor_calls import QUEUE_FULL_MESSAGE
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
    client's inbox, named by the subscription (`link`), image requests naming the preprocessor for
    the engine client to call (see `mmserve.protocol`). Until the subscription has named the engine
    client's inbox, everything goes as Ray calls (`add`, with the preprocessor's response started
    here), as do image requests to an engine client that does not take them over the link. For an
    engine pool, `engine` names the replica every call is for (`deployments/engine_pool.py`)."""

    def __init__(
        self, handle: DeploymentHandle, caller: str | None, engine: str = "", gone: asyncio.Event | None = None
    ) -> None:
        # By reference, whatever Ray's defaults (RAY_SERVE_THROUGHPUT_OPTIMIZED makes calls by
        # value): the preprocessor's response is resolved in the engine client, never here.
        self.handle = handle.options(_by_reference=True)
        # This replica's actor name: engine clients abort our requests if we die.
        self.caller = caller or ""
        self.engine = engine
        # Set once this engine's application is being deleted: Serve takes its replica out of the
        # routers at once, so a call to it would wait for a replica forever (see `unless_gone`).
        self.gone = gone
        self.demux = OutputDemux()
        # To the engine-client replica whose stream is being read (None: none yet, or it ended).
        self.link: LinkOutbox | None = None
        # Whether that engine client takes image requests over the link (`OutputBatch.takes_images`).
        self.link_takes_images = False
        self._reader: asyncio.Task[None] | None = None
        self._aborts: set[asyncio.Task[None]] = set()

    async def info(self) -> EngineInfo | None:
        return await self.unless_gone(_own_request(self.handle.info, engine=self.engine))

    async def unless_gone(self, response: DeploymentResponse | Awaitable[Any]) -> Any:
        """`response`'s result; given up (ReplicaLostError) once this engine is found gone."""
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
            raise ReplicaLostError("its engine application is being deleted")
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

    def send(self, request: EngineCoreRequest, images: PendingImages | None) -> bool:
        """Send a request over the link; False if there is none, or it does not take these images
        (then `add` it over Ray)."""
        if self.link is None:
            return False
        if images is None:
            self.link.send_nowait(encode(TextRequest(self.caller, request)))
            return True
        if not self.link_takes_images or (for_link := images.for_link()) is None:
            return False
        self.link.send_nowait(encode(ImageRequest(self.caller, request, *for_link)))
        return True

    def abort(self, request_id: str) -> None:
        """Fire and forget: the request is given up here whatever the engine client answers.
        Over the link if there is one; else a Ray call, outside the request's context, which is
        being cancelled (see above)."""
        if self.link is not None:
            self.link.send_nowait(encode(AbortRequests(self.caller, [request_id])))
            return
        task = asyncio.get_running_loop().create_task(self._abort(request_id), context=contextvars.Context())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, request_id: str) -> None:
        try:
            await _own_request(self.handle.abort, [request_id], self.caller, engine=self.engine)
        except Exception as exc:  # the engine client is gone: its requests went with it
            logger.debug("abort of %s failed: %s", request_id, exc)

    async def _read_outputs(self) -> None:
        """Follow the engine client's outputs for this replica, for the replica's life: batches
        arrive over ZMQ at this connection's inbox, while the `subscribe` call beside it says which
        engine-client replica sends them, and by ending, that it is gone; then the requests it
        carried fail and this subscribes again."""
        inbox = LinkInbox(node_ip())
        receiver = asyncio.get_running_loop().create_task(self._receive(inbox), name="engine-output-inbox")
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
                            self.link_takes_images = first.takes_images
                    error = ReplicaLostError("the engine client ended its output stream")
                except asyncio.CancelledError:
                    # Closed: end the call itself too, or the engine client would count it as
                    # ongoing, and Serve would wait for it before stopping a drained replica.
                    subscription.cancel()
                    raise
                except Exception as exc:
                    error = ReplicaLostError(describe(innermost_cause(exc)))
                self._close_link()
                if len(self.demux):
                    logger.warning("engine client output stream lost: %s", error)
                self.demux.lost(error)
                await asyncio.sleep(RESUBSCRIBE_DELAY_S)
        finally:
            self._close_link()
            receiver.cancel()
            inbox.close()

    def _close_link(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    async def _receive(self, inbox: LinkInbox) -> None:
        while True:
            self.demux.dispatch(decode_output_batch(await inbox.recv()))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._close_link()
        # Requests still waiting for outputs from here would wait forever.
        self.demux.lost(ReplicaLostError("the ingress closed its connection to this engine client"))


class HandleEngineCall:
    """One request through a `HandleEngineConnection`; Ray's failures leave it typed (see `EngineConnection`)."""

    def __init__(self, connection: HandleEngineConnection, request: EngineCoreRequest, images: PendingImages | None) -> None:
        self.connection = connection
        self.request = request
        self.images = images
        self._add: DeploymentResponse | None = None
        self._outputs: RequestOutputs | None = None
        # The engine client may hold the request (sent, not refused, not finished): `cancel` aborts it.
        self._held = False

    async def __aiter__(self) -> AsyncIterator[EngineEvent]:
        connection = self.connection
        request_id = self.request.request_id
        outputs = self._outputs = connection.demux.register(request_id)
        try:
            admission = await self._admit()
            if admission.refused is not None:
                self._held = False
                if admission.refused.kind == NOT_THIS_ENGINE:
                    raise ReplicaLostError(admission.refused.message)
                yield EngineEvent(refused=admission.refused)
                return
            replica = connection.demux.replica
            if replica is not None and admission.replica != replica:
                raise ReplicaLostError("the engine client that took this request was replaced")
            outputs.replica = admission.replica
            if admission.accepted is not None:
                yield EngineEvent(accepted=admission.accepted)
            while self._held:
                batch = await outputs.next()
                self._held = not batch[-1].finished
                yield EngineEvent(outputs=batch)
        finally:
            connection.demux.unregister(request_id)

    async def _send_add(self) -> Admission:
        connection = self.connection
        if self._outputs is not None and connection.send(self.request, self.images):
            self._held = True  # until the answer says otherwise
            self._outputs.awaiting_answer = True
            # If its answer never comes (the stream ended, the engine is gone, or this caller was
            # cancelled), this raises with `_held` still set: `cancel` aborts it, in case the engine
            # client took it.
            answer = await connection.unless_gone(self._outputs.next_answer())
            if answer.failed is not None:
                self._held = False  # the engine client did not take it
            return _admission(answer)
        images = self.images.response() if self.images is not None else None
        self._add = _own_request(connection.handle.add, self.request, images, connection.caller, engine=connection.engine)
        self._held = True  # until the answer says otherwise
        try:
            return decode_admission(await connection.unless_gone(self._add))
        except Exception:
            # The engine client does not hold the request: nothing to abort (an abort would make
            # it refuse a retry of the same request, after a preprocessing replica died).
            self._held = False
            raise

    async def _admit(self) -> Admission:
        """The engine client's answer to `add`, Ray's failures typed."""
        try:
            return await self._send_add()
        except (EngineDeadError, EngineNotReadyError):
            raise  # the engine client's own errors (Ray's task error is an instance of them too)
        except BackPressureError:
            raise GatewayBusyError("the gateway is at capacity; retry shortly") from None
        except Exception as exc:
            # Errors raised by a deployment this call depended on (the preprocessor) arrive
            # wrapped once per hop; hand the caller the original, typed error.
            inner = innermost_cause(exc)
            if isinstance(inner, BackPressureError):
                raise GatewayBusyError(QUEUE_FULL_MESSAGE) from None
            if not isinstance(inner, (RayError, RayServeException)):
                raise inner from None
            raise ReplicaLostError(describe(inner)) from None

    def cancel(self) -> None:
        """Give the request up: the engine client aborts it (or refuses its `add` if the abort
        overtakes it)."""
        if not self._held:
            return
        if self._add is not None:  # (None: sent over the link)
            try:
                self._add.cancel()
            except Exception:  # the call already failed (cancel re-raises that failure)
                pass
        self.connection.abort(self.request.request_id)


def _admission(answer: AddAnswer) -> Admission:
    """The admission an answer over the link holds; its failure raised as `add` over Ray would have."""
    if answer.admission is not None:
        return answer.admission
    failed = answer.failed
    if failed is None:
        raise RuntimeError(f"the engine client answered request {answer.request_id} with neither an admission nor a failure")
    if failed.kind == "dead":
        raise EngineDeadError(failed.message)
    if failed.kind == "not_ready":
        raise EngineNotReadyError(failed.message)
    raise RuntimeError(f"the engine client failed request {answer.request_id}: {failed.message}")


def _own_request(method: Any, *args: Any, **kwargs: Any) -> DeploymentResponse:
    """`method.remote(*args, **kwargs)` as a Serve request of its own. Calls made while serving one
    HTTP request inherit its request id, by which Serve's router hands the replica it chose to the
    call it chose it for: an engine pool's calls, each meant for its own replica, made at once (the
    engines' states, the children of `n` > 1) would be handed each other's replicas."""
    return contextvars.Context().run(method.remote, *args, **kwargs)

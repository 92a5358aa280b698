"""The engine router's Ray side: engine clients and the preprocessor reached through Serve handles, Ray's failures typed.

The routing itself (engine choice, retries, limits) is the plain `mmserve.openai.engine_router.
EngineRouter`; this module only adapts `DeploymentHandle`s to its `EngineConnection` and
`Preprocessing`, and turns Ray's exceptions into the typed errors it expects.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from mmserve.engine import EngineDeadError, EngineNotReadyError
from mmserve.engine.zmq_link import LinkInbox
from mmserve.multimodal import ImageBatchRequest
from mmserve.openai.engine_outputs import OutputDemux
from mmserve.openai.engine_router import EngineConnection, EngineRouter, EngineSource, ReplicaLostError, StaticEngines
from mmserve.openai.settings import RoutingSettings
from mmserve.protocol import NOT_THIS_ENGINE, Admission, EngineEvent, EngineInfo, GatewayBusyError, decode_admission, decode_output_batch
from mmserve.wire import EngineCoreRequest

from .engine_pool_members import pool_members
from .inline_args import cut_payloads

logger = logging.getLogger("ray.serve")

# Engine applications (`EngineApplications`): the one deployment each has, and how often the ingress
# asks Serve's controller which there are.
ENGINE_APPLICATION_DEPLOYMENT = "EngineClient0"
ENGINE_APPLICATIONS_REFRESH_S = 2.0

# After the output stream broke: wait this long before subscribing again (the engine client's
# replica is being replaced; Serve queues the call until the new one runs).
RESUBSCRIBE_DELAY_S = 0.2


def engine_router(
    engines: list[DeploymentHandle],
    engine_pool: DeploymentHandle | None,
    preprocessor: DeploymentHandle | None,
    wait_timeout_s: float,
    routing: RoutingSettings,
    engine_applications: str | None = None,
) -> EngineRouter:
    """The ingress's router over these engine-client deployments (one engine each) or this engine
    pool (one engine per replica, as many as Serve scales it to), the engine applications named
    `engine_applications`* (added and removed while serving), and the preprocessor."""
    caller = _replica_name()
    sources: list[EngineSource] = [StaticEngines([HandleEngineConnection(handle, caller) for handle in engines])]
    if engine_pool is not None:
        sources.append(EnginePoolMembers(engine_pool, caller))
    if engine_applications is not None:
        sources.append(EngineApplications(engine_applications, caller))
    return EngineRouter(
        sources,
        preprocessor=HandlePreprocessing(preprocessor) if preprocessor is not None else None,
        wait_timeout_s=wait_timeout_s,
        routing=routing,
    )


class EnginePoolMembers:
    """The engines of a pool: one connection per replica, as the pool's request router in this
    process last heard from Serve's controller (`deployments/engine_pool.py`). A replica that
    leaves (scaled down, replaced) is dropped here; the `EngineRouter` drains it."""

    def __init__(self, handle: DeploymentHandle, caller: str | None) -> None:
        # Options make the handle start its router now, which then hears of the replicas.
        self.handle = handle.options(_by_reference=True)
        self.caller = caller
        self._members: tuple[str, ...] | None = None
        self._connections: dict[str, HandleEngineConnection] = {}

    def engines(self) -> Mapping[str, EngineConnection]:
        members = pool_members(self.handle.app_name, self.handle.deployment_name)
        if members is not self._members:
            self._members = members
            listed = set(members or ())
            for engine in listed - self._connections.keys():
                self._connections[engine] = HandleEngineConnection(self.handle, self.caller, engine=engine)
            for engine in self._connections.keys() - listed:
                del self._connections[engine]
        return self._connections


class EngineApplications:
    """Engines added and removed while serving: one per Serve application whose name starts with
    `prefix` (each built by `serve_app:build_engine_app`: one engine client, `EngineClient0`), named
    by the application's name, the same in every ingress replica. Serve's controller is asked for
    the applications every `refresh_s` in the background; one being deleted (or gone) is no longer
    listed, so the `EngineRouter` drains it, and its replica stops once those streams are done."""

    def __init__(self, prefix: str, caller: str | None, refresh_s: float = ENGINE_APPLICATIONS_REFRESH_S) -> None:
        self.prefix = prefix
        self.caller = caller
        self.refresh_s = refresh_s
        self._names: set[str] = set()
        self._connections: dict[str, HandleEngineConnection] = {}
        # Set when the application's name is no longer listed: calls on their way there give up.
        self._gone: dict[str, asyncio.Event] = {}
        self._poller: asyncio.Task[None] | None = None

    def engines(self) -> Mapping[str, EngineConnection]:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll(), name="engine-applications", context=contextvars.Context())
        for name in self._names - self._connections.keys():
            handle = serve.get_deployment_handle(ENGINE_APPLICATION_DEPLOYMENT, app_name=name)
            self._gone[name] = asyncio.Event()
            self._connections[name] = HandleEngineConnection(handle, self.caller, gone=self._gone[name])
        return self._connections

    async def _poll(self) -> None:
        while True:
            try:
                self._names = await _running_applications(self.prefix)
            except Exception as exc:  # the controller is restarting: keep what was listed
                logger.warning("listing the engine applications failed: %s", exc)
            for name in self._gone.keys() - self._names:
                # No longer listed: calls on their way there give up, and a new connection is made
                # if the name is listed again.
                self._gone.pop(name).set()
                self._connections.pop(name, None)
            await asyncio.sleep(self.refresh_s)


async def _running_applications(prefix: str) -> set[str]:
    """Names of the Serve applications starting with `prefix` that are deployed or deploying (not
    being deleted, not failed to deploy)."""
    from ray.serve._private.application_state import StatusOverview
    from ray.serve.context import _get_global_client
    from ray.serve.generated.serve_pb2 import StatusOverview as StatusOverviewProto
    from ray.serve.schema import ApplicationStatus

    serving = {ApplicationStatus.RUNNING, ApplicationStatus.DEPLOYING, ApplicationStatus.UNHEALTHY}
    names = set()
    for raw in await _get_global_client()._controller.list_serve_statuses.remote():
        status = StatusOverview.from_proto(StatusOverviewProto.FromString(raw))
        if status.name.startswith(prefix) and status.app_status.status in serving:
            names.add(status.name)
    return names


class HandleEngineConnection:
    """One engine client through its deployment's handle: requests go as one `add` call each; their
    outputs come back over ZMQ to this replica's inbox, beside one long-lived `subscribe` call (see
    `mmserve.protocol`), read by a background task and handed to each request by `OutputDemux`.
    For an engine pool, `engine` names the replica every call is for (`deployments/engine_pool.py`)."""

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
        self._reader: asyncio.Task[None] | None = None
        self._aborts: set[asyncio.Task[None]] = set()

    async def info(self) -> EngineInfo | None:
        return await self.unless_gone(_own_request(self.handle.info, engine=self.engine))

    async def unless_gone(self, response: DeploymentResponse) -> Any:
        """`response`'s result; given up (ReplicaLostError) once this engine is found gone."""
        if self.gone is None:
            return await response
        call = asyncio.ensure_future(response)
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
            if call.done():
                return call.result()
            response.cancel()
            raise ReplicaLostError("its engine application is being deleted")
        finally:
            # Given up, answered, or this caller was cancelled: nothing awaits either any more.
            call.cancel()
            gone.cancel()

    def generate(self, request: EngineCoreRequest, images: object | None) -> "HandleEngineCall":
        if self._reader is None or self._reader.done():
            # Outside the request's context: Serve cancels the handle calls a request made when
            # that request is cancelled (its client left), and this stream serves every request.
            self._reader = asyncio.get_running_loop().create_task(
                self._read_outputs(), name="engine-outputs", context=contextvars.Context()
            )
        return HandleEngineCall(self, request, images)

    def abort(self, request_id: str) -> None:
        """Fire and forget: the request is given up here whatever the engine client answers.
        Outside the request's context, which is being cancelled (see above)."""
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
        inbox = LinkInbox(_node_ip())
        receiver = asyncio.get_running_loop().create_task(self._receive(inbox), name="engine-output-inbox")
        try:
            while True:
                try:
                    subscription = self.handle.options(stream=True).subscribe.remote(self.caller, inbox.address, engine=self.engine)
                    async for item in subscription:
                        if (replica := decode_output_batch(item).replica) is not None:
                            self.demux.connected(replica)
                    error = ReplicaLostError("the engine client ended its output stream")
                except asyncio.CancelledError:
                    # Closed: end the call itself too, or the engine client would count it as
                    # ongoing, and Serve would wait for it before stopping a drained replica.
                    subscription.cancel()
                    raise
                except Exception as exc:
                    error = ReplicaLostError(_describe(_unwrap(exc)))
                if len(self.demux):
                    logger.warning("engine client output stream lost: %s", error)
                self.demux.lost(error)
                await asyncio.sleep(RESUBSCRIBE_DELAY_S)
        finally:
            receiver.cancel()
            inbox.close()

    async def _receive(self, inbox: LinkInbox) -> None:
        while True:
            self.demux.dispatch(decode_output_batch(await inbox.recv()))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        # Requests still waiting for outputs from here would wait forever.
        self.demux.lost(ReplicaLostError("the ingress closed its connection to this engine client"))


class HandleEngineCall:
    """One request through a `HandleEngineConnection`; Ray's failures leave it typed (see `EngineConnection`)."""

    def __init__(self, connection: HandleEngineConnection, request: EngineCoreRequest, images: object | None) -> None:
        self.connection = connection
        self.request = request
        self.images = images
        self._add: DeploymentResponse | None = None
        # The engine client may hold the request (sent, not refused, not finished): `cancel` aborts it.
        self._held = False

    async def __aiter__(self) -> AsyncIterator[EngineEvent]:
        connection = self.connection
        request_id = self.request.request_id
        outputs = connection.demux.register(request_id)
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
        self._add = _own_request(connection.handle.add, self.request, self.images, connection.caller, engine=connection.engine)
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
            inner = _unwrap(exc)
            if isinstance(inner, BackPressureError):
                raise GatewayBusyError("the image preprocessing queue is full; retry shortly") from None
            if not isinstance(inner, (RayError, RayServeException)):
                raise inner from None
            raise ReplicaLostError(_describe(inner)) from None

    def cancel(self) -> None:
        """Give the request up: the engine client aborts it (or refuses its `add` if the abort
        overtakes it)."""
        if not self._held:
            return
        try:
            self._add.cancel()  # type: ignore[union-attr]  (set whenever _held is)
        except Exception:  # the call already failed (cancel re-raises that failure)
            pass
        self.connection.abort(self.request.request_id)


class HandlePreprocessing:
    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle.options(_by_reference=True)  # its response is an argument of `add` (above)

    def process(self, request: ImageBatchRequest) -> DeploymentResponse:
        """Unawaited: Ray resolves it in the engine client, so the pixels never pass through the ingress.
        Data URIs go inside the call, cut into pieces (`inline_args.py`), not through the object store."""
        cut = cut_payloads(request.urls)
        if cut is None:
            return self.handle.process.remote(request)
        counts, pieces = cut
        return self.handle.process.remote(msgspec.structs.replace(request, urls=[]), counts, *pieces)


def _own_request(method: Any, *args: Any, **kwargs: Any) -> DeploymentResponse:
    """`method.remote(*args, **kwargs)` as a Serve request of its own. Calls made while serving one
    HTTP request inherit its request id, by which Serve's router hands the replica it chose to the
    call it chose it for: an engine pool's calls, each meant for its own replica, made at once (the
    engines' states, the children of `n` > 1) would be handed each other's replicas."""
    return contextvars.Context().run(method.remote, *args, **kwargs)


def _replica_name() -> str | None:
    try:
        return serve.get_replica_context().replica_id.to_full_id_str()
    except Exception:  # not in a replica
        return None


def _node_ip() -> str:
    """Where engine clients reach this replica (they may run on other nodes)."""
    import ray

    return ray.util.get_node_ip_address()


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _unwrap(exc: BaseException) -> BaseException:
    """The innermost cause of a chain of Ray task errors."""
    seen = 0
    while seen < 8:
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException) or cause is exc:
            break
        exc, seen = cause, seen + 1
    return exc

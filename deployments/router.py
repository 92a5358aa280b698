"""The engine router's Ray side: where the engines come from (engine-client deployments, an engine pool, engine applications), reached through Serve handles, and the preprocessor's name.

The routing itself (engine choice, retries, limits) is the plain `mmserve.transit.router.
EngineRouter`; this module gives it its `EngineSource`s and `Preprocessing`; one engine client as an
`EngineConnection` is `deployments/engine_connection.py`.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Mapping

from ray import serve
from ray.serve.handle import DeploymentHandle

from mmserve.transit.router import EngineConnection, EngineRouter, EngineSource, StaticEngines
from mmserve.transit.settings import RoutingSettings
from mmserve.transit.engine_link import PreprocessorName

from .engine_connection import HandleEngineConnection
from .engine_pool_members import pool_members
from .ray_node import replica_ids

logger = logging.getLogger("ray.serve")

# Engine applications (`EngineApplications`): the one deployment each has, and how often the ingress
# asks Serve's controller which there are.
ENGINE_APPLICATION_DEPLOYMENT = "EngineClient0"
ENGINE_APPLICATIONS_REFRESH_S = 2.0


def engine_router(
    engines: list[DeploymentHandle],
    engine_pool: DeploymentHandle | None,
    preprocessor: DeploymentHandle | None,
    wait_timeout_s: float,
    routing: RoutingSettings,
    engine_applications: str | None = None,
    preprocessor_version: str = "",
) -> EngineRouter:
    """The ingress's router over these engine-client deployments (one engine each) or this engine
    pool (one engine per replica, as many as Serve scales it to), the engine applications named
    `engine_applications`* (added and removed while serving), and the preprocessor."""
    caller = replica_ids()[0] or None
    sources: list[EngineSource] = [StaticEngines([HandleEngineConnection(handle, caller, wait_timeout_s) for handle in engines])]
    if engine_pool is not None:
        sources.append(EnginePoolMembers(engine_pool, caller, wait_timeout_s))
    if engine_applications is not None:
        sources.append(EngineApplications(engine_applications, caller, wait_timeout_s))
    return EngineRouter(
        sources,
        preprocessor=(
            PreprocessorName(preprocessor.app_name, preprocessor.deployment_name, preprocessor_version) if preprocessor is not None else None
        ),
        wait_timeout_s=wait_timeout_s,
        routing=routing,
    )


class EnginePoolMembers:
    """The engines of a pool: one connection per replica, as the pool's request router in this
    process last heard from Serve's controller (`deployments/engine_pool.py`). A replica that
    leaves (scaled down, replaced) is dropped here; the `EngineRouter` drains it."""

    def __init__(self, handle: DeploymentHandle, caller: str | None, link_timeout_s: float) -> None:
        # Options make the handle start its router now, which then hears of the replicas.
        self.handle = handle.options()
        self.caller = caller
        self.link_timeout_s = link_timeout_s
        self._members: tuple[str, ...] | None = None
        self._connections: dict[str, HandleEngineConnection] = {}

    def engines(self) -> Mapping[str, EngineConnection]:
        members = pool_members(self.handle.app_name, self.handle.deployment_name)
        if members is not self._members:
            self._members = members
            listed = set(members or ())
            for engine in listed - self._connections.keys():
                self._connections[engine] = HandleEngineConnection(self.handle, self.caller, self.link_timeout_s, engine=engine)
            for engine in self._connections.keys() - listed:
                del self._connections[engine]
        return self._connections


class EngineApplications:
    """Engines added and removed while serving: one per Serve application whose name starts with
    `prefix` (each built by `serve_app:build_engine_app`: one engine client, `EngineClient0`), named
    by the application's name, the same in every ingress replica. Serve's controller is asked for
    the applications every `refresh_s` in the background; one being deleted (or gone) is no longer
    listed, so the `EngineRouter` drains it, and its replica stops once those streams are done."""

    def __init__(self, prefix: str, caller: str | None, link_timeout_s: float, refresh_s: float = ENGINE_APPLICATIONS_REFRESH_S) -> None:
        self.prefix = prefix
        self.caller = caller
        self.link_timeout_s = link_timeout_s
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
            self._connections[name] = HandleEngineConnection(handle, self.caller, self.link_timeout_s, gone=self._gone[name])
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

"""Engine routing, as a plain class: which engine client serves a request, retries before the first output, engine limits.

Engine state comes from each engine client's `info()`, refreshed at most once per interval, so
a dead or starting engine is skipped without a round trip per request. An engine's load is the
requests in flight from this router plus the requests waiting in the engine's queue as of its
last scheduler stats (what a full KV cache or batch turns into), plus, while those stats show its
KV cache nearly full, enough to put it past the imbalance bound. Among ready engines the one that
recently served the request's images or its longest prompt prefix wins if its load is within the
configured bound of the least-loaded engine's (`engine_affinity.py`); for content this router has not
routed, the engine its hash names, the same in every ingress replica, within that bound; otherwise the
least loaded.

The engines come from `EngineSource`s: engine-client deployments made with the application (always
the same engines), or an engine pool that Serve scales, whose replicas come and go. An engine that
leaves is drained: sent nothing new, and its connection (which holds the replica) closed once the
requests this router sent it have finished, so Serve can stop it without cutting a stream.
How engine clients are reached (Ray Serve handles, ZMQ links) is the deployments' business
(`deployments/router.py`, `engine_connection.py`): this class sees them through `EngineConnection`;
the preprocessor, which the engine clients call, only by its name (`pending_images.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from mmserve.engine import EngineDeadError, EngineNotReadyError, InvalidRequestError
from mmserve.multimodal import ImageBatchRequest
from mmserve.wire import EngineCoreRequest

from .engine_link import EngineEvent, EngineInfo, PreprocessorName
from .affinity import AffinityKeys, AffinityTable, EngineId, affinity_keys, choose_engine, home_engine
from .pending_images import PendingImages
from .refusals import GatewayBusyError, LinkLost, refusal_error
from .settings import RoutingSettings

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class EngineLimits:
    """What the serving layer needs from the engines' handshake."""

    max_model_len: int
    engine_kind: str  # "vllm" or "mmserve-builtin"
    dtype: str = "bfloat16"


class EngineRouting(Protocol):
    """What the serving layer asks of the router (the class below, or a test's stand-in)."""

    async def limits(self, wait: bool = True) -> EngineLimits: ...

    def generate(self, request: EngineCoreRequest, images: object | None = None) -> AsyncIterator[EngineEvent]: ...

    def preprocess(self, request: ImageBatchRequest, group: str = "", choices: int = 1) -> object:
        """The request's images, to pass to `generate` with each of its `choices` engine requests
        (`group`: the request's id when there are several)."""
        ...


class NoEngineAliveError(EngineDeadError):
    """Every engine is dead or closed (none starting): there is nowhere to send a request."""


class EngineCall(Protocol):
    """One request on an engine client: its `EngineEvent`s, until it finished or failed."""

    def __aiter__(self) -> AsyncIterator[EngineEvent]: ...

    def cancel(self) -> None:
        """Give the request up before it finished (the engine aborts it)."""
        ...


class EngineConnection(Protocol):
    """One engine client as the router reaches it. Failures arrive typed: the engine's own
    errors, `GatewayBusyError` for a full tier, `LinkLost` for a request or replica lost on the way."""

    async def info(self) -> EngineInfo | None:
        """The engine's state; None: the engine is gone (a pool replica that was stopped)."""
        ...

    def generate(self, request: EngineCoreRequest, images: PendingImages | None) -> EngineCall: ...

    def close(self) -> None:
        """Stop reading the engine client's outputs (the replica is shutting down)."""
        ...


class EngineSource(Protocol):
    """Where engines come from: one engine-client deployment (always the same engine), or an
    engine pool whose replicas come and go as it scales (`deployments/router.py`)."""

    def engines(self) -> Mapping[EngineId, EngineConnection]:
        """The engines there are now, by a name that is the same in every ingress replica. An
        engine that is no longer listed is being taken away: the router sends it nothing new and
        closes its connection once its requests here have finished (its drain)."""
        ...


class StaticEngines:
    """Engines that stay for the application's life (an engine-client deployment each), named by position."""

    def __init__(self, connections: list[EngineConnection]) -> None:
        self._engines = {str(index): connection for index, connection in enumerate(connections)}

    def engines(self) -> Mapping[EngineId, EngineConnection]:
        return self._engines


@dataclass
class _Engine:
    """The router's view of one engine."""

    connection: EngineConnection
    info: EngineInfo | None = None
    in_flight: int = 0  # requests from this router on it
    routed: int = 0  # requests this router gave it
    draining: bool = False  # left its source: nothing new, closed when in_flight is 0


class EngineRouter:
    def __init__(
        self,
        sources: list[EngineSource],
        *,
        preprocessor: PreprocessorName | None = None,
        wait_timeout_s: float,
        refresh_interval_s: float = 1.0,
        info_timeout_s: float = 5.0,
        routing: RoutingSettings,
    ) -> None:
        self._sources = sources
        self._engines: dict[EngineId, _Engine] = {}
        self._preprocessor = preprocessor
        self._routing = routing
        self.affinity = AffinityTable(routing.affinity_entries)
        self._wait_timeout_s = wait_timeout_s
        self._refresh_interval_s = refresh_interval_s
        self._info_timeout_s = info_timeout_s
        self._refreshed_at = 0.0
        self._refresh_lock = asyncio.Lock()
        self._sync_engines()

    def _sync_engines(self) -> None:
        """Take in the engines the sources list now; start draining those they no longer list."""
        listed: dict[EngineId, EngineConnection] = {}
        for source in self._sources:
            listed.update(source.engines())
        for name, connection in listed.items():
            if name not in self._engines:
                self._engines[name] = _Engine(connection)
                if self._refreshed_at:  # not the first listing
                    logger.info("engine %s joined: routing to it once it is ready", name)
        for name, engine in list(self._engines.items()):
            if name not in listed and not engine.draining:
                engine.draining = True
                engine.info = None
                self.affinity.forget_engine(name)
                logger.info("engine %s is being taken away: draining its %d requests from here", name, engine.in_flight)
            self._close_if_drained(name)

    def _close_if_drained(self, name: EngineId) -> None:
        engine = self._engines.get(name)
        if engine is not None and engine.draining and engine.in_flight == 0:
            engine.connection.close()  # ends this replica's hold on it (its output stream)
            del self._engines[name]

    def _routable(self) -> list[EngineId]:
        return [name for name, engine in self._engines.items() if not engine.draining]

    async def refresh(self) -> dict[EngineId, EngineInfo | None]:
        async with self._refresh_lock:
            if time.monotonic() - self._refreshed_at < self._refresh_interval_s:
                return self._current_infos()
            self._sync_engines()
            names = self._routable()
            results = await asyncio.gather(
                *(asyncio.wait_for(self._engines[n].connection.info(), self._info_timeout_s) for n in names),
                return_exceptions=True,
            )
            for name, result in zip(names, results):
                engine = self._engines.get(name)
                if engine is None or engine.draining:
                    continue  # left while its info was asked for
                now = result if isinstance(result, EngineInfo) else None
                if _is_ready(engine.info) and not _is_ready(now):
                    self.affinity.forget_engine(name)  # dead, restarting or unreachable: its caches are gone
                engine.info = now
            self._refreshed_at = time.monotonic()
            return self._current_infos()

    def _current_infos(self) -> dict[EngineId, EngineInfo | None]:
        return {name: engine.info for name, engine in self._engines.items() if not engine.draining}

    def _ready_engines(self) -> list[EngineId]:
        return [name for name, engine in self._engines.items() if not engine.draining and _is_ready(engine.info)]

    def load(self, name: EngineId) -> int:
        """Requests in flight from this router on the engine, plus those queued in the engine, plus
        `max_imbalance + 1` when its KV cache is full (`routing.kv_cache_full`)."""
        engine = self._engines[name]
        info = engine.info
        if info is None:
            return engine.in_flight
        kv_full = info.engine_kv_cache_usage is not None and info.engine_kv_cache_usage >= self._routing.kv_cache_full
        return engine.in_flight + (info.engine_waiting or 0) + (self._routing.max_imbalance + 1 if kv_full else 0)

    def _choose(self, ready: list[EngineId], keys: AffinityKeys | None) -> EngineId:
        loads = {name: self.load(name) for name in ready}
        routed = {name: self._engines[name].routed for name in ready}
        affine = self.affinity.affine_engines(keys) if keys is not None else {}
        home = home_engine(keys, ready) if keys is not None else None
        name = choose_engine(ready, loads, routed, affine, self._routing.max_imbalance, home)
        if keys is not None:
            self.affinity.record(keys, name)
        self._engines[name].routed += 1
        return name

    async def _wait_for_ready(self) -> list[EngineId]:
        deadline = time.monotonic() + self._wait_timeout_s
        while True:
            await self.refresh()
            ready = self._ready_engines()
            if ready:
                return ready
            if time.monotonic() >= deadline:
                infos = list(self._current_infos().values())
                states = [info.state if info else "unreachable" for info in infos]
                reasons = [info.death_reason for info in infos if info and info.death_reason]
                if any(s in ("dead", "closed") for s in states) and "starting" not in states:
                    raise NoEngineAliveError(f"no engine is alive ({', '.join(reasons) or states})")
                raise EngineNotReadyError(f"no engine is ready (states: {states or 'no engine yet'})")
            await asyncio.sleep(0.2)
            self._refreshed_at = 0.0

    def close(self) -> None:
        for engine in self._engines.values():
            engine.connection.close()

    async def infos(self) -> dict[EngineId, EngineInfo | None]:
        """Each engine's last known state, by name (engines being drained left out)."""
        return await self.refresh()

    async def limits(self, wait: bool = True) -> EngineLimits:
        """Limits of a ready engine; waits for one unless `wait` is False (then raises at once)."""
        if wait:
            ready = await self._wait_for_ready()
        else:
            await self.refresh()
            ready = self._ready_engines()
            if not ready:
                raise EngineNotReadyError("no engine is ready")
        info = self._engines[ready[0]].info
        assert info is not None and info.max_model_len is not None
        return EngineLimits(
            max_model_len=info.max_model_len,
            engine_kind="mmserve-builtin" if info.builtin else "vllm",
            dtype=info.dtype or "bfloat16",
        )

    def preprocess(self, request: ImageBatchRequest, group: str = "", choices: int = 1) -> PendingImages:
        """The request's images, for the engine client that takes the request to have the
        preprocessor process them (`PendingImages`): the pixels never pass through this process."""
        if self._preprocessor is None:
            raise InvalidRequestError("this application has no image preprocessor", "messages")
        return PendingImages(request, self._preprocessor, group, choices)

    async def generate(self, request: EngineCoreRequest, images: PendingImages | None = None) -> AsyncIterator[EngineEvent]:
        """Stream the request from the engine chosen by load and affinity (see the module's doc).

        Until the first output a failure is retried once where that is safe: an engine found
        dead goes to another ready engine (nothing was generated), and a request whose engine
        client was lost under it goes again (preprocessing has no side effects).
        """
        tried: set[EngineId] = set()
        retried_lost = False
        keys = None
        if self._routing.affinity and len(self._routable()) > 1:
            keys = affinity_keys(request.prompt_token_ids or [], images.image_keys if images is not None else ())
        while True:
            ready = [name for name in await self._wait_for_ready() if name not in tried]
            if not ready:
                raise EngineDeadError("every ready engine failed this request before its first output")
            name = self._choose(ready, keys)
            tried.add(name)
            engine = self._engines[name]
            engine.in_flight += 1
            call = engine.connection.generate(request, images)
            finished = produced = False
            retry: BaseException | None = None
            try:
                async for event in call:
                    if event.refused is not None:
                        finished = True
                        raise refusal_error(event.refused)
                    if event.accepted is None:
                        produced = True
                    yield event
                finished = True
                return
            except (EngineDeadError, EngineNotReadyError) as exc:
                self._refreshed_at = 0.0  # look again before routing the next request
                self.affinity.forget_engine(name)
                if produced or len(self._routable()) == 1:
                    raise
                retry = exc
            except LinkLost as exc:
                # The engine client, or the request on its way there, was lost: nothing was
                # generated, so it goes again once, to any engine ready (its replacement too).
                self._refreshed_at = 0.0
                if produced:
                    raise EngineDeadError(f"the engine client serving this request failed: {exc}") from None
                if retried_lost or (images is not None and images.request is None):  # (its URLs dropped: accepted once)
                    raise GatewayBusyError(f"the engine client serving this request was lost: {exc}; retry shortly") from None
                retried_lost = True
                tried.discard(name)
                retry = exc
            finally:
                engine.in_flight -= 1
                if not finished:
                    call.cancel()
                self._close_if_drained(name)
            logger.warning("request %s: no output yet, trying again after: %s", request.request_id, retry)


def _is_ready(info: EngineInfo | None) -> bool:
    return info is not None and info.state == "ready"

"""Engine-client deployment: one replica per vLLM engine, a thin shell over `EngineClient`.

The replica binds the engine's ZMQ sockets and stays bound for its whole life, so the engine
(a `vllm serve --headless` process, or the built-in engine this replica starts itself) can
connect whenever it is ready. `check_health` fails once the engine is dead, so Ray Serve
replaces the replica, which then waits for a new engine on the same addresses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve

from mmserve.builtin_engine.launcher import BuiltinEngineProcess
from mmserve.engine import EngineAddresses, EngineClient, EngineClientConfig, EngineState, InvalidRequestError, admit
from mmserve.engine.frame_diagnostics import FrameTrace
from mmserve.engine.mm_cache import EngineCacheSettings
from mmserve.multimodal import ImagesRefused, PlaceholderMismatch, ProcessedImages, attach_images
from mmserve.protocol import EngineEvent, EngineInfo, PromptAccepted, RequestRefused, encode_event
from mmserve.wire import EngineCoreRequest

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class BuiltinEngineOptions:
    """How this replica starts its built-in engine (`serve_app`'s `builtin_engine` settings)."""

    model_dir: Path
    max_model_len: int = 4096
    max_num_seqs: int = 256
    step_interval_ms: float = 2.0


@dataclass(frozen=True)
class EngineClientSettings:
    """One engine client's settings, made by `serve_app` from the application's config."""

    addresses: EngineAddresses
    handshake_timeout_s: float = 900.0
    health_check_interval_s: float = 1.0
    health_check_timeout_s: float = 10.0
    # How long a request waits for a starting engine before it gets a 503.
    engine_wait_timeout_s: float = 30.0
    # Engine requests in flight on this engine; beyond, requests are refused (429).
    max_in_flight: int = 1024
    # Diagnostics: remember where the last N zero-copy frames lived.
    trace_wire_frames: int = 0
    # Set: this replica starts the built-in engine itself.
    builtin_engine: BuiltinEngineOptions | None = None
    # The engine's multimodal cache, mirrored to send images it holds by hash only.
    mm_cache: EngineCacheSettings = EngineCacheSettings()
    # Set: this replica launches its engine on Ray (`vllm serve --headless`) and restarts it.
    engine_launch: EngineLaunchOptions | None = None


@dataclass(frozen=True)
class EngineLaunchOptions:
    """How to launch one engine (from the application's `engine_launch`)."""

    model: str
    vllm_command: list[str]
    engine_args: dict[str, Any]
    # Ray resources of the engine: bundle 1 of the replica's placement group.
    resources: dict[str, float]
    env: dict[str, str]
    restart_backoff_initial_s: float = 1.0
    restart_backoff_max_s: float = 30.0


class EngineClientServer:
    """Plain class (testable without Ray): an engine client plus, optionally, its built-in engine."""

    def __init__(self, config: EngineClientSettings) -> None:
        self.config = config
        self.client = self._new_client(config.addresses.handshake)
        self.builtin: BuiltinEngineProcess | None = None
        # The Ray actor running this engine's `vllm serve --headless` (engine_launch only).
        self.launcher: Any = None
        self.engine_restarts = 0
        self._start_task: asyncio.Task[Any] | None = None
        self._relaunch_task: asyncio.Task[None] | None = None

    def _new_client(self, handshake: str) -> EngineClient:
        config = self.config
        return EngineClient(
            EngineClientConfig(
                addresses=dataclasses.replace(config.addresses, handshake=handshake),
                handshake_timeout_s=config.handshake_timeout_s,
                health_check_interval_s=config.health_check_interval_s,
                health_check_timeout_s=config.health_check_timeout_s,
                trace_frames=config.trace_wire_frames,
                mm_cache=config.mm_cache,
            )
        )

    async def start(self) -> None:
        """Bind now; complete the handshake in the background (the engine may take minutes)."""
        self.client.bind()
        logger.info("engine client listening for an engine on %s", self.client.handshake_address)
        if (options := self.config.builtin_engine) is not None:
            self.builtin = BuiltinEngineProcess.start(
                handshake=self.client.handshake_address,
                model_dir=options.model_dir,
                max_model_len=options.max_model_len,
                max_num_seqs=options.max_num_seqs,
                step_interval_ms=options.step_interval_ms,
            )
            logger.info("started the mmserve BUILT-IN engine (deterministic tokens, no real model), pid %d", self.builtin.pid)
        elif self.config.engine_launch is not None:
            await self._launch_engine()
        self._start_task = asyncio.create_task(self.client.start())
        self._start_task.add_done_callback(_log_start_failure)

    async def _launch_engine(self) -> None:
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from deployments.engine_launcher import EngineLauncher
        from mmserve.launcher.supervisor import vllm_serve_argv

        launch = self.config.engine_launch
        assert launch is not None and self.client.handshake_address is not None
        argv = vllm_serve_argv(launch.vllm_command, launch.model, self.client.handshake_address, launch.engine_args)
        resources = dict(launch.resources)
        self.launcher = EngineLauncher.options(
            num_cpus=resources.pop("CPU", 0), num_gpus=resources.pop("GPU", 0), resources=resources,
            # Bundle 1 of this replica's STRICT_PACK group: the engine's resources, on this node.
            scheduling_strategy=PlacementGroupSchedulingStrategy(get_current_placement_group(), placement_group_bundle_index=1),
        ).remote(argv, dict(launch.env), {"backoff_initial_s": launch.restart_backoff_initial_s, "backoff_max_s": launch.restart_backoff_max_s})
        await self.launcher.start.remote()
        self._relaunch_task = asyncio.create_task(self._relaunch_on_death(), name="engine-relaunch")

    async def _relaunch_on_death(self) -> None:
        """A launched engine that dies or hangs is restarted; a new engine client waits for it on
        the same handshake address (the old one released it after its handshake)."""
        while True:
            client = self.client
            await client.dead_event.wait()
            reason = client.death_reason or "engine dead"
            self.engine_restarts += 1
            self.client = self._new_client(client.handshake_address or self.config.addresses.handshake)
            self.client.bind()
            self._start_task = asyncio.create_task(self.client.start())
            self._start_task.add_done_callback(_log_start_failure)
            if client.hung:
                # Its process is still there, answering nobody: kill it and start a new one. An
                # engine that exited (disconnect, ENGINE_CORE_DEAD) is restarted by its launcher
                # with back-off on its own.
                await self.launcher.restart.remote(f"its engine client declared it hung: {reason}")
            await client.close()

    async def generate(
        self, request: EngineCoreRequest, images: ProcessedImages | ImagesRefused | None = None
    ) -> AsyncIterator[EngineEvent]:
        """Stream the request's outputs. With images (resolved by Ray from the preprocessor's
        response, zero-copy), expand their placeholders first and announce the final prompt."""
        ready = await self.client.wait_ready(self.config.engine_wait_timeout_s)
        limit = self.config.max_in_flight
        # Client-caused refusals are events, not exceptions (see RequestRefused).
        if self.client.num_in_flight >= limit:
            yield EngineEvent(refused=RequestRefused("overloaded", f"the engine has {limit} requests in flight; retry shortly"))
            return
        if isinstance(images, ImagesRefused):
            yield EngineEvent(refused=RequestRefused("image", images.message, "messages"))
            return
        if images is not None:
            try:
                request = attach_images(request, images)
                # Checked before the prompt is announced (the engine client checks again on send).
                request = admit(request, ready.max_model_len)
            except PlaceholderMismatch as exc:
                yield EngineEvent(refused=RequestRefused("invalid", str(exc), "messages"))
                return
            except InvalidRequestError as exc:
                yield EngineEvent(refused=RequestRefused("invalid", str(exc), exc.param))
                return
            accepted = PromptAccepted(request.prompt_token_ids or [], len(images.images), images.preprocess_ms)
            yield EngineEvent(accepted=accepted)
        async for batch in self.client.generate(request):
            yield EngineEvent(outputs=batch)

    async def info(self) -> EngineInfo:
        ready = self.client.ready
        return EngineInfo(
            state=self.client.state.value,
            builtin=self.builtin is not None,
            handshake_address=self.client.handshake_address,
            death_reason=self.client.death_reason,
            vllm_version=ready.vllm_version if ready else None,
            max_model_len=ready.max_model_len if ready else None,
            dtype=ready.dtype if ready else None,
            max_num_seqs=ready.max_num_seqs if ready else None,
            num_in_flight=self.client.num_in_flight,
            builtin_pid=self.builtin.pid if self.builtin else None,
            bytes_sent=self.client.bytes_sent,
            requests_sent=self.client.requests_sent,
            engine_running=stats.num_running_reqs if (stats := self.client.scheduler_stats) else None,
            engine_waiting=stats.num_waiting_reqs if stats else None,
            mm_items_skipped=self.client.mm_items_skipped,
            mm_cache_miss_resends=self.client.mm_cache_miss_resends,
        )

    async def call_utility(self, method: str, *args: Any, timeout_s: float = 10.0) -> Any:
        await self.client.wait_ready(self.config.engine_wait_timeout_s)
        return await self.client.call_utility(method, *args, timeout_s=timeout_s)

    def check_health(self) -> None:
        if self.launcher is not None:
            # A launched engine is restarted here; only a lost launcher needs a new replica.
            if self._relaunch_task is not None and self._relaunch_task.done():
                raise RuntimeError(f"engine relauncher stopped: {self._relaunch_task}")
            return
        if self.client.state in (EngineState.DEAD, EngineState.CLOSED):
            raise RuntimeError(f"engine is {self.client.state.value}: {self.client.death_reason}")

    async def shutdown(self) -> None:
        dead = self.client.state is EngineState.DEAD
        if self._relaunch_task is not None:
            self._relaunch_task.cancel()
        await self.client.close()
        if self.launcher is not None:
            import ray

            try:
                await self.launcher.stop.remote()
            finally:
                ray.kill(self.launcher)
        if self.builtin is not None:
            if dead and self.builtin.is_alive():
                # Dead or hung (a SIGSTOPped process would sit on a SIGTERM forever): no
                # graceful stop to wait for.
                self.builtin.process.kill()
                self.builtin.process.wait()
            else:
                self.builtin.stop()


class CallerWatch:
    """Cancels the requests of callers (ingress replicas) that died.

    Ray does not stop an actor's streaming generator when the process consuming it dies, so
    without this an engine request whose ingress was killed would run to `max_tokens` for
    nobody. Callers are looked up by actor name once per `interval_s` while they have
    requests here; a name that no longer resolves is a dead replica.
    """

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._tasks: dict[str, set[asyncio.Task[Any]]] = {}
        self._loop: asyncio.Task[None] | None = None

    def add(self, caller: str, task: asyncio.Task[Any]) -> None:
        self._tasks.setdefault(caller, set()).add(task)
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._run(), name="caller-watch")

    def discard(self, caller: str, task: asyncio.Task[Any]) -> None:
        tasks = self._tasks.get(caller)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._tasks[caller]

    async def _run(self) -> None:
        while self._tasks:
            await asyncio.sleep(self.interval_s)
            for caller in list(self._tasks):
                if await asyncio.to_thread(_actor_alive, caller):
                    continue
                tasks = self._tasks.pop(caller, set())
                logger.warning("caller %s is gone: cancelling its %d request(s)", caller, len(tasks))
                for task in tasks:
                    task.cancel()


def _actor_alive(name: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace="serve")
    except ValueError:  # no live actor by that name
        return False
    except Exception:  # GCS unreachable or the like: assume alive rather than cancel
        return True
    return True


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _log_start_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("engine did not start: %s", task.exception())


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
    async def __init__(self, settings: EngineClientSettings) -> None:
        self.server = EngineClientServer(settings)
        self._callers = CallerWatch()
        await self.server.start()

    async def generate(
        self, request: EngineCoreRequest, images: ProcessedImages | ImagesRefused | None = None, caller: str | None = None
    ) -> AsyncIterator[bytes]:
        """Events travel to the ingress msgpack-encoded (`mmserve.protocol`): Ray moves bytes
        without pickling them, which is most of the per-token cost of a stream.

        `caller`: the calling replica's actor name; if that replica dies, the request is
        cancelled (and so aborted in the engine) instead of running on for nobody.
        """
        task = asyncio.current_task()
        if caller and task is not None:
            self._callers.add(caller, task)
        try:
            async for item in self.server.generate(request, images):
                yield encode_event(item)
        finally:
            if caller and task is not None:
                self._callers.discard(caller, task)

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
        return {**status, "restarts_requested": self.server.engine_restarts, "engine_client_node_id": _node_id()}

    def frame_traces(self) -> list[FrameTrace]:
        return list(self.server.client.frame_traces)

    def pid(self) -> int:
        return os.getpid()

    async def __del__(self) -> None:
        await self.server.shutdown()

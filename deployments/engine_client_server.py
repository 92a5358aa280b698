"""The engine client's server side, a plain class (testable without Ray Serve): an `EngineClient`,
the engine it serves (the built-in engine started here, one launched on Ray, or an external
one), admission of requests with their images, and replacement of an engine that dies.

`deployments/engine_client.py` wraps it as a Serve deployment; its settings, made by `serve_app`,
live here beside it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from mmserve.builtin_engine.launcher import BuiltinEngineProcess
from mmserve.engine import (
    EngineAddresses, EngineClient, EngineClientConfig, EngineError, EngineState, InvalidRequestError, admit,
)
from mmserve.engine.mm_adds import Refill
from mmserve.engine.outputs import OutputSink
from mmserve.engine.mm_cache import EngineCacheSettings
from mmserve.multimodal import PlaceholderMismatch, ProcessedImages, attach_images
from mmserve.transit.engine_link import Admission, EngineInfo, PromptAccepted
from mmserve.transit.refusals import Refusal
from mmserve.wire import EngineCoreRequest

logger = logging.getLogger("ray.serve")
# A request's images processed anew (by the preprocessor that processed them first).
Reprocess: TypeAlias = Callable[[], Awaitable[ProcessedImages | Refusal]]


@dataclass(frozen=True)
class BuiltinEngineOptions:
    """How this replica starts its built-in engine (`serve_app`'s `builtin_engine` settings)."""

    model_dir: Path
    max_model_len: int
    max_num_seqs: int
    step_interval_ms: float
    step_us_per_sequence: float
    step_us_per_prefill_token: float


@dataclass(frozen=True)
class EngineClientSettings:
    """One engine client's settings, made by `serve_app` from the application's config (the one
    home of their defaults: no field has one here)."""

    addresses: EngineAddresses
    handshake_timeout_s: float
    health_check_interval_s: float
    health_check_timeout_s: float
    # How long a request waits for a starting engine before it gets a 503.
    engine_wait_timeout_s: float
    # Engine requests in flight on this engine; beyond, requests are refused (429).
    max_in_flight: int
    # Diagnostics: remember where the last N zero-copy frames lived.
    trace_wire_frames: int
    # Set: this replica starts the built-in engine itself.
    builtin_engine: BuiltinEngineOptions | None
    # The engine's multimodal cache, mirrored to send images it holds by hash only.
    mm_cache: EngineCacheSettings
    # Set: this replica launches its engine on Ray (`vllm serve --headless`) and restarts it.
    engine_launch: EngineLaunchOptions | None


@dataclass(frozen=True)
class EngineLaunchOptions:
    """How to launch one engine (from the application's `engine_launch`)."""

    model: str
    vllm_command: list[str]
    engine_args: dict[str, Any]
    # Ray resources of the engine: bundle 1 of the replica's placement group.
    resources: dict[str, float]
    env: dict[str, str]
    restart_backoff_initial_s: float
    restart_backoff_max_s: float


def engine_client_config(settings: EngineClientSettings, handshake: str) -> EngineClientConfig:
    """The `EngineClient`'s part of `settings`, waiting for its engine on `handshake`."""
    return EngineClientConfig(
        addresses=dataclasses.replace(settings.addresses, handshake=handshake),
        handshake_timeout_s=settings.handshake_timeout_s,
        health_check_interval_s=settings.health_check_interval_s,
        health_check_timeout_s=settings.health_check_timeout_s,
        trace_frames=settings.trace_wire_frames,
        mm_cache=settings.mm_cache,
    )


class EngineClientServer:
    """Plain class (testable without Ray): an engine client plus, optionally, its built-in engine."""

    def __init__(self, config: EngineClientSettings) -> None:
        self.config = config
        self.client = self._new_client(config.addresses.handshake)
        self.builtin: BuiltinEngineProcess | None = None
        # The Ray actor running this engine's `vllm serve --headless` (engine_launch only).
        self.launcher: Any = None
        self.launcher_name: str | None = None
        self.engine_restarts = 0
        self._start_task: asyncio.Task[Any] | None = None
        self._relaunch_task: asyncio.Task[None] | None = None
        self._launcher_watch: asyncio.Task[None] | None = None
        # Why this replica cannot serve again by itself (its launcher is gone): health checks fail with it.
        self.unrecoverable: str | None = None
        # The client of the engine that died last, reported until its replacement is ready.
        self.dead_client: EngineClient | None = None

    def _new_client(self, handshake: str) -> EngineClient:
        return EngineClient(engine_client_config(self.config, handshake))

    async def start(self) -> None:
        """Bind now; complete the handshake in the background (the engine may take minutes)."""
        self.client.bind()
        logger.info("engine client listening for an engine on %s", self.client.handshake_address)
        if self.config.builtin_engine is not None:
            self._start_builtin()
        elif self.config.engine_launch is not None:
            await self._launch_engine()
        self._start_task = asyncio.create_task(self.client.start())
        self._start_task.add_done_callback(_log_start_failure)
        self._relaunch_task = asyncio.create_task(self._replace_on_death(), name="engine-replace")

    def _start_builtin(self) -> None:
        options = self.config.builtin_engine
        assert options is not None
        self.builtin = BuiltinEngineProcess.start(
            handshake=self.client.handshake_address,
            model_dir=options.model_dir,
            max_model_len=options.max_model_len,
            max_num_seqs=options.max_num_seqs,
            step_interval_ms=options.step_interval_ms,
            step_us_per_sequence=options.step_us_per_sequence,
            step_us_per_prefill_token=options.step_us_per_prefill_token,
        )
        logger.info("started the mmserve BUILT-IN engine (deterministic tokens, no real model), pid %d", self.builtin.pid)

    async def _launch_engine(self) -> None:
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from deployments.engine_launcher import EngineLauncher
        from mmserve.launcher.supervisor import vllm_serve_argv

        launch = self.config.engine_launch
        assert launch is not None and self.client.handshake_address is not None
        argv = vllm_serve_argv(launch.vllm_command, launch.model, self.client.handshake_address, launch.engine_args)
        resources = dict(launch.resources)
        # Named, so that an operator (or a test) can find it: `ray.get_actor(name, namespace="serve")`.
        self.launcher_name = f"mmserve-engine-launcher-{uuid.uuid4().hex[:12]}"
        self.launcher = EngineLauncher.options(
            name=self.launcher_name, namespace="serve",
            num_cpus=resources.pop("CPU", 0), num_gpus=resources.pop("GPU", 0), resources=resources,
            # Bundle 1 of this replica's STRICT_PACK group: the engine's resources, on this node.
            scheduling_strategy=PlacementGroupSchedulingStrategy(get_current_placement_group(), placement_group_bundle_index=1),
        ).remote(argv, dict(launch.env), {"backoff_initial_s": launch.restart_backoff_initial_s, "backoff_max_s": launch.restart_backoff_max_s})
        await self.launcher.start.remote()
        self._launcher_watch = asyncio.create_task(self._watch_launcher(), name="launcher-watch")

    async def _watch_launcher(self) -> None:
        """A launcher is not restarted (its engine dies with it: parent-death signal), so an engine
        client whose launcher is gone waits for a handshake that never comes: said once, and every
        health check fails from then on, so that Serve replaces the replica (and with it, both)."""
        try:
            await self.launcher.watch.remote()
        except Exception as exc:  # RayActorError: killed, crashed, or its node lost
            text = str(exc).strip().splitlines()
            self.unrecoverable = f"its engine launcher is gone ({type(exc).__name__}: {text[0][:200] if text else ''})"
            logger.error(
                "engine client %s: %s; failing health checks so that Serve replaces this replica and its engine",
                self.client.handshake_address, self.unrecoverable,
            )

    async def _replace_on_death(self) -> None:
        """An engine that dies or hangs is replaced in place: a new engine client waits on the same
        handshake address (the old one released it after its handshake), and the engine comes back
        to it: the built-in engine started again here, a launched one restarted by its launcher
        (with back-off), an external one by whatever supervises it. The death was logged once by
        the engine client; Serve's health check (which logs a traceback per failed check) is left
        for this task ending, which nothing here can repair."""
        while True:
            client = self.client
            await client.dead_event.wait()
            reason = client.death_reason or "engine dead"
            self.engine_restarts += 1
            self.dead_client = client
            self.client = self._new_client(client.handshake_address or self.config.addresses.handshake)
            self.client.bind()
            if self.builtin is not None:
                self._stop_builtin(dead=True)
                self._start_builtin()
            self._start_task = asyncio.create_task(self.client.start())
            self._start_task.add_done_callback(_log_start_failure)
            if client.hung and self.launcher is not None:
                # Its process is still there, answering nobody: kill it and start a new one. An
                # engine that exited (disconnect, ENGINE_CORE_DEAD) is restarted by its launcher
                # with back-off on its own.
                await self.launcher.restart.remote(f"its engine client declared it hung: {reason}")
            await client.close()

    async def add(
        self, request: EngineCoreRequest, images: ProcessedImages | Refusal | None, sink: OutputSink,
        reprocess: Reprocess | None = None,
    ) -> Admission:
        """Send the request to the engine; its outputs go to `sink`. With images (mapped from the
        object store where the preprocessor wrote them), expand their placeholders first and
        announce the final prompt. Client-caused refusals are answers, not exceptions (see
        `Refusal`). Images recalled without pixels (`RecentImages`) go by hash only, and
        `reprocess` gets their pixels if the engine turns out not to hold them."""
        ready = await self.client.wait_ready(self.config.engine_wait_timeout_s)
        if (refused := self.overloaded()) is not None:
            return Admission(refused=refused)
        if isinstance(images, Refusal):
            return Admission(refused=images)
        accepted = refill = None
        try:
            if images is not None:
                unexpanded, request = request, attach_images(request, images)
                # Checked before the prompt is announced (the engine client checks again on send).
                request = admit(request, ready.max_model_len)
                recalled = any(not image.fields for image in images.images)
                preprocess_ms = None if recalled else images.preprocess_ms
                accepted = PromptAccepted(request.prompt_token_ids or [], len(images.images), preprocess_ms)
                if recalled and reprocess is not None:
                    refill = _refill(unexpanded, request, reprocess, ready.max_model_len)
            await self.client.add(request, sink, refill)
        except PlaceholderMismatch as exc:
            return Admission(refused=Refusal("invalid", str(exc), "messages"))
        except _RefillRefused as exc:
            return Admission(refused=exc.refusal)
        except InvalidRequestError as exc:
            return Admission(refused=Refusal("invalid", str(exc), exc.param))
        return Admission(accepted=accepted)

    def overloaded(self) -> Refusal | None:
        """The refusal of a request now, if the engine holds `max_in_flight` requests already (checked
        again by `add`; before it, by whoever would process images for nothing)."""
        limit = self.config.max_in_flight
        if self.client.num_in_flight >= limit:
            return Refusal("overloaded", f"the engine has {limit} requests in flight; retry shortly")
        return None

    async def info(self) -> EngineInfo:
        ready = self.client.ready
        # Until its replacement is ready, the engine that died is what there is to report.
        shown = self.dead_client if self.dead_client is not None and ready is None else self.client
        return EngineInfo(
            state=EngineState.DEAD.value if shown is self.dead_client else shown.state.value,
            builtin=self.builtin is not None,
            handshake_address=self.client.handshake_address,
            death_reason=shown.death_reason,
            vllm_version=ready.vllm_version if ready else None,
            max_model_len=ready.max_model_len if ready else None,
            dtype=ready.dtype if ready else None,
            max_num_seqs=ready.max_num_seqs if ready else None,
            num_in_flight=self.client.num_in_flight,
            builtin_pid=self.builtin.pid if self.builtin else None,
            bytes_sent=self.client.bytes_sent,
            requests_sent=self.client.adds.requests_sent,
            engine_running=stats.num_running_reqs if (stats := self.client.scheduler_stats) else None,
            engine_waiting=stats.num_waiting_reqs if stats else None,
            engine_kv_cache_usage=stats.kv_cache_usage if stats else None,
            mm_items_skipped=self.client.adds.items_skipped,
            mm_cache_miss_resends=self.client.adds.cache_miss_resends,
        )

    async def call_utility(self, method: str, *args: Any, timeout_s: float = 10.0) -> Any:
        await self.client.wait_ready(self.config.engine_wait_timeout_s)
        return await self.client.call_utility(method, *args, timeout_s=timeout_s)

    async def node_lost(self, reason: str) -> None:
        """This replica's node left the Ray cluster (`deployments/raylet_watch.py`): every request
        fails now with `reason`, and the built-in engine is stopped; its process ends next."""
        self.unrecoverable = reason
        for task in (self._relaunch_task, self._launcher_watch):
            if task is not None:
                task.cancel()
        await self.client.close(reason)
        if self.builtin is not None:
            self._stop_builtin(dead=True)

    def check_health(self) -> None:
        # A dead engine is replaced in place (`_replace_on_death`); only that task ending, or the
        # launcher that would restart it being gone, needs a new replica.
        if self.unrecoverable is not None:
            raise RuntimeError(self.unrecoverable)
        if self._relaunch_task is not None and self._relaunch_task.done():
            raise RuntimeError(f"engine replacement stopped: {self._relaunch_task}")

    def _stop_builtin(self, dead: bool) -> None:
        assert self.builtin is not None
        if dead and self.builtin.is_alive():
            # Dead or hung (a SIGSTOPped process would sit on a SIGTERM forever): no
            # graceful stop to wait for.
            self.builtin.process.kill()
            self.builtin.process.wait()
        else:
            self.builtin.stop()

    async def shutdown(self) -> None:
        dead = self.client.state is EngineState.DEAD
        if self._relaunch_task is not None:
            self._relaunch_task.cancel()
        if self._launcher_watch is not None:
            self._launcher_watch.cancel()  # the launcher is stopped next: not a loss to report
        await self.client.close()
        if self.launcher is not None:
            import ray

            try:
                await self.launcher.stop.remote()
            finally:
                ray.kill(self.launcher)
        if self.builtin is not None:
            self._stop_builtin(dead)


class _RefillRefused(EngineError):
    """The preprocessor refused to process anew images a request was sent with by hash only."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(f"the request's images could not be processed again: {refusal.message}")
        self.refusal = refusal


def _refill(unexpanded: EngineCoreRequest, sent: EngineCoreRequest, reprocess: Reprocess, max_model_len: int) -> Refill:
    """`sent` (`unexpanded` with its images by hash only) with its images processed anew: the same
    prompt and images, now with their pixels (anything else would contradict the prompt announced)."""

    async def refill() -> EngineCoreRequest:
        images = await reprocess()
        if isinstance(images, Refusal):
            raise _RefillRefused(images)
        request = admit(attach_images(unexpanded, images), max_model_len)
        same_images = [f.mm_hash for f in request.mm_features or []] == [f.mm_hash for f in sent.mm_features or []]
        if request.prompt_token_ids != sent.prompt_token_ids or not same_images:
            raise EngineError("the request's images processed again differ from those it was sent with")
        return request

    return refill


def _log_start_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("engine did not start: %s", task.exception())

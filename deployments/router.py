"""Routing engine requests from the ingress to engine-client deployments (Ray handles).

Engine state comes from each engine client's `info()`, refreshed in the background, so a
dead or starting engine is skipped without a round trip per request. Among ready engines
the one with the fewest requests in flight from this ingress wins.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from mmserve.engine import EngineDeadError, EngineNotReadyError, EngineOverloadedError, InvalidRequestError
from mmserve.multimodal import ImageBatchRequest
from mmserve.multimodal.errors import ImageInputError
from mmserve.protocol import EngineEvent, GatewayBusyError, RequestRefused, decode_event
from mmserve.wire import EngineCoreRequest
from serve_app.openai_serving import EngineLimits

from .engine_client import EngineInfo

logger = logging.getLogger("ray.serve")


class EngineHandleRouter:
    def __init__(
        self,
        handles: list[DeploymentHandle],
        *,
        preprocessor: DeploymentHandle | None = None,
        wait_timeout_s: float,
        refresh_interval_s: float = 1.0,
    ) -> None:
        self._handles = handles
        self._preprocessor = preprocessor
        self._infos: list[EngineInfo | None] = [None] * len(handles)
        self._in_flight = [0] * len(handles)
        self._wait_timeout_s = wait_timeout_s
        self._refresh_interval_s = refresh_interval_s
        self._refreshed_at = 0.0
        self._refresh_lock = asyncio.Lock()
        self._caller_name: str | None = None

    async def refresh(self) -> list[EngineInfo | None]:
        async with self._refresh_lock:
            if time.monotonic() - self._refreshed_at < self._refresh_interval_s:
                return self._infos
            results = await asyncio.gather(
                *(asyncio.wait_for(h.info.remote(), 5.0) for h in self._handles), return_exceptions=True
            )
            self._infos = [r if isinstance(r, EngineInfo) else None for r in results]
            self._refreshed_at = time.monotonic()
            return self._infos

    def _ready_indices(self) -> list[int]:
        return [i for i, info in enumerate(self._infos) if info is not None and info.state == "ready"]

    async def _wait_for_ready(self) -> list[int]:
        deadline = time.monotonic() + self._wait_timeout_s
        while True:
            await self.refresh()
            ready = self._ready_indices()
            if ready:
                return ready
            if time.monotonic() >= deadline:
                states = [info.state if info else "unreachable" for info in self._infos]
                reasons = [info.death_reason for info in self._infos if info and info.death_reason]
                if any(s in ("dead", "closed") for s in states) and "starting" not in states:
                    raise EngineDeadError(f"no engine is alive ({', '.join(reasons) or states})")
                raise EngineNotReadyError(f"no engine is ready (states: {states})")
            await asyncio.sleep(0.2)
            self._refreshed_at = 0.0

    async def infos(self) -> list[EngineInfo | None]:
        return await self.refresh()

    async def limits(self, wait: bool = True) -> EngineLimits:
        """Limits of a ready engine; waits for one unless `wait` is False (then raises at once)."""
        if wait:
            ready = await self._wait_for_ready()
        else:
            await self.refresh()
            ready = self._ready_indices()
            if not ready:
                raise EngineNotReadyError("no engine is ready")
        info = self._infos[ready[0]]
        assert info is not None and info.max_model_len is not None
        return EngineLimits(
            max_model_len=info.max_model_len,
            engine_kind="mmserve-builtin" if info.builtin else "vllm",
            dtype=info.dtype or "bfloat16",
        )

    def preprocess(self, request: ImageBatchRequest) -> "PendingImages":
        """Start preprocessing. The response is handed to the engine client unawaited: Ray
        resolves it there, so the pixels never pass through this process."""
        if self._preprocessor is None:
            raise InvalidRequestError("this application has no image preprocessor", "messages")
        return PendingImages(request, self._preprocessor.process.remote(request))

    def _caller(self) -> str | None:
        """This replica's actor name: engine clients abort our requests if we die."""
        if self._caller_name is None:
            try:
                self._caller_name = serve.get_replica_context().replica_id.to_full_id_str()
            except Exception:  # not in a replica (tests of the plain class)
                self._caller_name = ""
        return self._caller_name or None

    async def generate(
        self, request: EngineCoreRequest, images: "PendingImages | DeploymentResponse | None" = None
    ) -> AsyncIterator[EngineEvent]:
        """Stream the request from the least-loaded ready engine.

        Until the first output a failure is retried once where that is safe: an engine found
        dead goes to another ready engine (nothing was generated), and a preprocessing replica
        that died takes the images to a new one (preprocessing has no side effects).
        """
        tried: set[int] = set()
        reprocessed = False
        while True:
            ready = [i for i in await self._wait_for_ready() if i not in tried]
            if not ready:
                raise EngineDeadError("every ready engine failed this request before its first output")
            index = min(ready, key=lambda i: self._in_flight[i])
            tried.add(index)
            self._in_flight[index] += 1
            pixels = images.response if isinstance(images, PendingImages) else images
            response = self._handles[index].options(stream=True).generate.remote(request, pixels, caller=self._caller())
            finished = produced = False
            retry: BaseException | None = None
            try:
                async for item in response:
                    event = decode_event(item)
                    if event.refused is not None:
                        finished = True
                        raise _refusal_error(event.refused)
                    if event.accepted is None:
                        produced = True
                    yield event
                finished = True
                return
            except (EngineDeadError, EngineNotReadyError) as exc:
                self._refreshed_at = 0.0  # look again before routing the next request
                if produced or len(self._handles) == 1:
                    raise
                retry = exc
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
                # A replica died under this request (the preprocessor's or an engine client's).
                self._refreshed_at = 0.0
                if produced:
                    raise EngineDeadError(f"the engine client serving this request failed: {_describe(inner)}") from None
                if isinstance(images, PendingImages) and not reprocessed and self._preprocessor is not None:
                    logger.warning("request %s: retrying after %s", request.request_id, _describe(inner))
                    images = PendingImages(images.request, self._preprocessor.process.remote(images.request))
                    reprocessed = True
                    tried.discard(index)
                    retry = inner
                elif isinstance(images, PendingImages):
                    raise GatewayBusyError(f"image preprocessing failed: {_describe(inner)}; retry shortly") from None
                elif len(self._handles) > 1:
                    retry = inner
                else:
                    raise EngineDeadError(f"the engine client serving this request failed: {_describe(inner)}") from None
            finally:
                self._in_flight[index] -= 1
                if not finished:
                    # Cancels the engine client's generator, whose cleanup aborts the request.
                    try:
                        response.cancel()
                    except Exception:  # the call already failed (it re-raises that failure)
                        pass
            logger.warning("request %s: no output yet, trying again after: %s", request.request_id, retry)


class PendingImages:
    """Preprocessing in progress: its response, and the request, to start it again if the
    replica doing it dies."""

    __slots__ = ("request", "response")

    def __init__(self, request: ImageBatchRequest, response: DeploymentResponse) -> None:
        self.request = request
        self.response = response


def _refusal_error(refusal: RequestRefused) -> Exception:
    """The typed error a refusal stands for (see `RequestRefused`)."""
    if refusal.kind == "image":
        return ImageInputError(refusal.message)  # the message already names the image
    if refusal.kind == "overloaded":
        return EngineOverloadedError(refusal.message)
    return InvalidRequestError(refusal.message, refusal.param)


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

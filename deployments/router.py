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

from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from mmserve.engine import EngineDeadError, EngineNotReadyError, EngineOverloadedError, InvalidRequestError, PromptAccepted
from mmserve.multimodal import ImageBatchRequest
from mmserve.wire import EngineCoreOutput, EngineCoreRequest
from mmserve.wire.codec import decode_output_batch
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

    async def limits(self) -> EngineLimits:
        ready = await self._wait_for_ready()
        info = self._infos[ready[0]]
        assert info is not None and info.max_model_len is not None
        return EngineLimits(
            max_model_len=info.max_model_len,
            engine_kind="mmserve-builtin" if info.builtin else "vllm",
            dtype=info.dtype or "bfloat16",
        )

    def preprocess(self, request: ImageBatchRequest) -> DeploymentResponse:
        """Start preprocessing. The response is handed to the engine client unawaited: Ray
        resolves it there, so the pixels never pass through this process."""
        if self._preprocessor is None:
            raise InvalidRequestError("this application has no image preprocessor", "messages")
        return self._preprocessor.process.remote(request)

    async def generate(
        self, request: EngineCoreRequest, images: DeploymentResponse | None = None
    ) -> AsyncIterator[PromptAccepted | list[EngineCoreOutput]]:
        ready = await self._wait_for_ready()
        index = min(ready, key=lambda i: self._in_flight[i])
        self._in_flight[index] += 1
        response = self._handles[index].options(stream=True).generate.remote(request, images)
        finished = False
        try:
            async for item in response:
                yield decode_output_batch(item) if isinstance(item, bytes) else item
            finished = True
        except (EngineDeadError, EngineNotReadyError):
            self._refreshed_at = 0.0  # look again before routing the next request
            raise
        except BackPressureError:
            raise EngineOverloadedError("the gateway is at capacity; retry shortly", status=503) from None
        except Exception as exc:
            # Errors raised by a deployment this call depended on (the preprocessor) arrive
            # wrapped once per hop; hand the caller the original, typed error.
            inner = _unwrap(exc)
            if isinstance(inner, BackPressureError):
                raise EngineOverloadedError("the image preprocessing queue is full; retry shortly", status=503) from None
            raise inner from None
        finally:
            self._in_flight[index] -= 1
            if not finished:
                # Cancels the engine client's generator, whose cleanup aborts the request.
                response.cancel()


def _unwrap(exc: BaseException) -> BaseException:
    """The innermost cause of a chain of Ray task errors."""
    seen = 0
    while seen < 8:
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException) or cause is exc:
            break
        exc, seen = cause, seen + 1
    return exc

"""The engine router's Ray side: engine clients and the preprocessor reached through Serve handles, Ray's failures typed.

The routing itself (engine choice, retries, limits) is the plain `mmserve.openai.engine_router.
EngineRouter`; this module only adapts `DeploymentHandle`s to its `EngineConnection` and
`Preprocessing`, and turns Ray's exceptions into the typed errors it expects.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from mmserve.engine import EngineDeadError, EngineNotReadyError
from mmserve.multimodal import ImageBatchRequest
from mmserve.openai.engine_router import EngineRouter, ReplicaLostError
from mmserve.openai.settings import RoutingSettings
from mmserve.protocol import EngineInfo, GatewayBusyError
from mmserve.wire import EngineCoreRequest


def engine_router(
    engines: list[DeploymentHandle], preprocessor: DeploymentHandle | None, wait_timeout_s: float, routing: RoutingSettings
) -> EngineRouter:
    """The ingress's router over these engine-client (and preprocessor) handles."""
    caller = _replica_name()
    return EngineRouter(
        [HandleEngineConnection(handle, caller) for handle in engines],
        preprocessor=HandlePreprocessing(preprocessor) if preprocessor is not None else None,
        wait_timeout_s=wait_timeout_s,
        routing=routing,
    )


class HandleEngineConnection:
    """One engine-client deployment, through its handle."""

    def __init__(self, handle: DeploymentHandle, caller: str | None) -> None:
        self.handle = handle
        # This replica's actor name: engine clients abort our requests if we die.
        self.caller = caller

    async def info(self) -> EngineInfo:
        return await self.handle.info.remote()

    def generate(self, request: EngineCoreRequest, images: object | None) -> "HandleEngineCall":
        return HandleEngineCall(self.handle.options(stream=True).generate.remote(request, images, caller=self.caller))


class HandleEngineCall:
    """A streaming generate call; Ray's failures leave it typed (see `EngineConnection`)."""

    def __init__(self, response) -> None:
        self.response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for item in self.response:
                yield item
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
        """Cancels the engine client's generator, whose cleanup aborts the request."""
        try:
            self.response.cancel()
        except Exception:  # the call already failed (it re-raises that failure)
            pass


class HandlePreprocessing:
    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle

    def process(self, request: ImageBatchRequest) -> DeploymentResponse:
        """Unawaited: Ray resolves it in the engine client, so the pixels never pass through the ingress."""
        return self.handle.process.remote(request)


def _replica_name() -> str | None:
    try:
        return serve.get_replica_context().replica_id.to_full_id_str()
    except Exception:  # not in a replica
        return None


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

"""Ingress deployment: the OpenAI HTTP API (FastAPI), a thin shell over `mmserve.openai.OpenAIServer`.

The request body is read and size-checked before parsing (`mmserve.openai.intake`), parsed by
pydantic in strict mode straight from bytes, and every failure leaves as OpenAI's error JSON,
recognised by type (`mmserve.openai.errors`).

No `from __future__ import annotations` here: the route annotations must be real objects.
`@serve.ingress` pickles the FastAPI app by value for its replicas, and a route function pickled
by value keeps only the globals its code names, so a string annotation such as "Request" cannot
be resolved there. FastAPI >= 0.137 analyses routes lazily, in the replica, and then asks for a
query parameter named `request` (422 on every route). tests/deployments/test_ingress_routes.py
guards this.
"""

import asyncio
import hmac
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve.handle import DeploymentHandle

from mmserve.openai.errors import OpenAIError, bad_request, internal_error, openai_error
from mmserve.openai.body_memory import PARSE_CHARGE_PER_BYTE, BudgetLease, ByteBudget, HeapTrimmer, map_large_blocks_separately
from mmserve.openai.intake import BodyCaps, CountLimits, ShapeChecker, default_body_budget, read_body, scan_data_uris
from mmserve.openai.metrics import CLIENT_CLOSED, Metrics, RequestRecord, send_request_log_to
from mmserve.openai.protocol import ChatCompletionRequest, CompletionRequest
from mmserve.openai.serving import OpenAIServer
from mmserve.openai.settings import ServingSettings
from mmserve.openai.sse import ErrorEvent

from .replica_env import INGRESS_REPLICA_ENV, runtime_env
from .replica_logs import log_package_to_replica
from .router import engine_router

logger = logging.getLogger("ray.serve")

api = FastAPI(title="mmserve", description="OpenAI-compatible multimodal gateway to vLLM engines")


def _error_response(exc: OpenAIError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
    return JSONResponse(exc.body().model_dump(), status_code=exc.status, headers=headers)


@api.exception_handler(OpenAIError)
async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return _error_response(exc)


@api.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return _error_response(OpenAIError(str(exc.detail), status=exc.status_code))


@api.exception_handler(Exception)
async def _unexpected_error(_: Request, exc: Exception) -> Response:
    if isinstance(exc, (ClientDisconnect, TaskCancelledError)):
        # The client left while its response streamed: Serve's proxy cancels the replica's
        # `receive` (TaskCancelledError), the direct ingress says ClientDisconnect. Not an error
        # of ours; the request's own log line says 499.
        return Response(status_code=CLIENT_CLOSED)
    error = openai_error(exc)
    if error is None:
        logger.exception("unexpected error while serving a request")
        error = internal_error(exc)
    return _error_response(error)


class _ClientLeft(Exception):
    """The client disconnected before its answer was ready."""


async def _unless_client_leaves(request: Request, work: Any) -> Any:
    """`await work`, cancelled if the client disconnects first (as vLLM's `with_cancellation` does).
    Serve cancels a handler whose client leaves only on some paths: behind HAProxy the replica's
    own HTTP server sees the disconnect, and nothing else would stop a non-streamed generation."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_client_disconnected(request))
    try:
        await asyncio.wait((task, listener), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        listener.cancel()
    if not task.done():
        task.cancel()  # its own clean-up aborts the request in the engine
        raise _ClientLeft()
    return task.result()


async def _client_disconnected(request: Request) -> None:
    """Returns once the ASGI server says the client is gone (the body has been read by then)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a receive that fails (Serve's proxy cancels it) means the client is gone
        return


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return f"Invalid JSON body: {first.get('msg')}", None
    return f"{loc}: {first.get('msg')}" if loc else str(first.get("msg")), loc or None


# Half a CPU each: Serve spreads them over the nodes with room (`ingress_actor_options`).
INGRESS_CPUS = 0.5


def ingress_actor_options(resources: dict[str, float]) -> dict[str, Any]:
    """An ingress replica's Ray actor options, with the extra Ray resources that say where it may
    run (`ingress_resources`); its runtime environment always (see `INGRESS_REPLICA_ENV`)."""
    return {"num_cpus": INGRESS_CPUS, "resources": dict(resources), "runtime_env": runtime_env(INGRESS_REPLICA_ENV)}


# No access line of Serve's per request: the request line (`mmserve.requests`, in the replica's log
# file) records each one, and Serve's would go to the console too (see `mmserve.openai.metrics._FILE_ONLY`).
@serve.deployment(
    ray_actor_options=ingress_actor_options({}),
    max_ongoing_requests=1024,
    logging_config={"enable_access_log": False},
)
@serve.ingress(api)
class Ingress:
    def __init__(
        self, settings: ServingSettings, engines: list[DeploymentHandle], preprocessor: DeploymentHandle | None = None,
        engine_pool: DeploymentHandle | None = None, engine_applications: str | None = None,
    ) -> None:
        log_package_to_replica()
        self.settings = settings
        self.router = engine_router(
            engines, engine_pool, preprocessor, settings.engine_wait_timeout_s, settings.routing, engine_applications,
            settings.preprocessor_version,
        )
        self.metrics = Metrics()
        send_request_log_to(logger)
        self.server = OpenAIServer(settings, self.router, self.metrics)
        limits = settings.limits
        self.body_caps = BodyCaps.from_settings(settings, images_allowed=self.server.image_family is not None)
        # Large bodies' memory back to the OS once they are done.
        map_large_blocks_separately()
        self.heap_trimmer = HeapTrimmer()
        needed = default_body_budget(self.body_caps)
        budget = limits.ingress_body_budget_bytes or needed
        if budget < needed and self.server.image_family is not None:
            logger.warning(
                "limits.ingress_body_budget_bytes=%d is below what the largest request the image caps allow "
                "needs to be parsed (%d): such requests get 413", budget, needed,
            )
        self.budget = ByteBudget(budget, limits.small_request_bytes, self.heap_trimmer.request)
        self.shapes = ShapeChecker(CountLimits.from_settings(settings))
        if missing := sorted(name for name, value in INGRESS_REPLICA_ENV.items() if os.environ.get(name) != value):
            logger.warning(
                "this ingress replica runs without %s (a Serve config that sets the Ingress's ray_actor_options "
                "replaces the runtime_env the application gives it): its code runs in a thread of its own, "
                "more CPU per stream; put %s in that runtime_env's env_vars",
                ", ".join(f"{name}={INGRESS_REPLICA_ENV[name]}" for name in missing), INGRESS_REPLICA_ENV,
            )
        key = settings.api_key or os.environ.get("MMSERVE_API_KEY") or None
        self._api_key = key.encode() if key else None
        logger.info(
            "mmserve ingress serving %s from %s (API key %s)",
            self.server.model_name, settings.model_dir, "required" if self._api_key else "not required",
        )

    def _authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Constant-time comparison: the time taken must not reveal how much of a guess matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._api_key):
            raise OpenAIError("Invalid or missing API key (send `Authorization: Bearer <key>`)", status=401, code="invalid_api_key")

    async def _parse(self, request: Request, model: type[BaseModel], chat: bool, lease: BudgetLease) -> Any:
        """Body → request model, each size rule checked before the step it protects (intake.py)."""
        body = await read_body(
            request.stream(), request.headers.get("content-length"), self.body_caps, chat, lease,
            self.settings.limits.body_read_timeout_s,
        )
        image_chars = sum(span.end - span.start for span in scan_data_uris(body, self.body_caps)) if chat else 0
        self.shapes.check(body, chat)
        try:
            parsed = model.model_validate_json(body)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            raise bad_request(message, param) from None
        # The body goes; its image payloads stay until the preprocessor has them.
        lease.hold(PARSE_CHARGE_PER_BYTE * image_chars, len(body))
        return parsed

    async def _serve(self, request: Request, endpoint: str, model: type[BaseModel], call) -> Any:
        """Authorize, parse, run; record the outcome for metrics and the request's log line."""
        record = RequestRecord(endpoint)
        record.lease = self.budget.lease()
        self.metrics.in_flight.inc()
        try:
            self._authorize(request)
            body = await self._parse(request, model, endpoint == "chat", record.lease)
            record.stream = bool(getattr(body, "stream", False))
            result = await _unless_client_leaves(request, call(body, record))
        except asyncio.CancelledError:
            # The client went away (Serve cancels the handler): not an error of ours.
            record.status, record.error = CLIENT_CLOSED, "client disconnected"
            self._finish(record)
            raise
        except _ClientLeft:
            record.status, record.error = CLIENT_CLOSED, "client disconnected"
            self._finish(record)
            return Response(status_code=CLIENT_CLOSED)
        except (ClientDisconnect, TaskCancelledError):
            # The client went away while sending its body (Serve's proxy cancels the receive).
            record.status, record.error = CLIENT_CLOSED, "client disconnected while sending the body"
            self._finish(record)
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:
            error = openai_error(exc)
            if error is None:
                logger.exception("unexpected error while serving a request")
                error = internal_error(exc)
                record.status, record.error = 500, type(exc).__name__
            else:
                record.status, record.error = error.status, error.message
            self._finish(record)
            return _error_response(error)
        if isinstance(result, AsyncIterator):
            return StreamingResponse(self._recorded_stream(result, record), media_type="text/event-stream")
        self._finish(record)
        return JSONResponse(result.model_dump(exclude_none=True))

    async def _recorded_stream(self, chunks: AsyncIterator[str], record: RequestRecord) -> AsyncIterator[str]:
        completed = False
        try:
            async for chunk in chunks:
                if isinstance(chunk, ErrorEvent):
                    record.error = f"error event in stream: {chunk.message}"
                yield chunk
            completed = True
        finally:
            if not completed and record.error is None:
                record.status, record.error = CLIENT_CLOSED, "client disconnected"
            self._finish(record)

    def _finish(self, record: RequestRecord) -> None:
        if record.lease is not None:
            record.lease.release()
        self.metrics.in_flight.dec()
        self.metrics.observe_finished(record)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        return await self._serve(request, "chat", ChatCompletionRequest, self.server.chat)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return await self._serve(request, "completions", CompletionRequest, self.server.completion)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Any:
        try:
            self._authorize(request)
        except OpenAIError as exc:
            return _error_response(exc)
        return JSONResponse((await self.server.models()).model_dump(exclude_none=True))

    @api.get("/metrics")
    async def prometheus_metrics(self) -> Response:
        self.metrics.body_budget_held.set(self.budget.used)
        self.metrics.body_budget_limit.set(self.budget.limit)
        for engine, info in (await self.router.infos()).items():
            self.metrics.engine_up.labels(engine).set(1 if info is not None and info.state == "ready" else 0)
            if info is not None:
                self.metrics.engine_in_flight.labels(engine).set(info.num_in_flight)
                self.metrics.engine_bytes.labels(engine).set(info.bytes_sent)
                self.metrics.engine_images_recalled.labels(engine).set(info.images_recalled)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    def pid(self) -> int:
        return os.getpid()

    def __del__(self) -> None:
        # Ends this replica's output streams: the engine clients abort what it had in flight.
        self.router.close()

    @api.get("/health")
    async def health(self) -> Any:
        infos = await self.router.infos()
        engines = [
            {"engine": name, "state": i.state if i else "unreachable", "builtin": i.builtin if i else None,
             "reason": i.death_reason if i else None, "in_flight": i.num_in_flight if i else None}
            for name, i in infos.items()
        ]
        healthy = any(e["state"] == "ready" for e in engines)
        return JSONResponse({"status": "ok" if healthy else "unavailable", "engines": engines}, status_code=200 if healthy else 503)

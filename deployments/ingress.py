"""Ingress deployment: the OpenAI HTTP API (FastAPI) over `OpenAIServer`.

The request body is read and size-checked before parsing, parsed by pydantic in strict mode
straight from bytes, and every failure leaves as OpenAI's error JSON.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig
from serve_app.errors import OpenAIError, bad_request
from serve_app.openai_serving import OpenAIServer
from serve_app.schemas import ChatCompletionRequest, CompletionRequest

from .router import EngineHandleRouter

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
async def _unexpected_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error while serving a request")
    return _error_response(OpenAIError(f"internal error: {type(exc).__name__}", status=500))


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return f"Invalid JSON body: {first.get('msg')}", None
    return f"{loc}: {first.get('msg')}" if loc else str(first.get("msg")), loc or None


@serve.deployment(
    ray_actor_options={"num_cpus": 0.5},
    max_ongoing_requests=1024,
)
@serve.ingress(api)
class Ingress:
    def __init__(
        self, config: dict[str, Any], engines: list[DeploymentHandle], preprocessor: DeploymentHandle | None = None
    ) -> None:
        self.config = AppConfig.model_validate(config)
        self.router = EngineHandleRouter(
            engines, preprocessor=preprocessor, wait_timeout_s=self.config.engine_wait_timeout_s
        )
        self.server = OpenAIServer(self.config, self.router)
        logger.info("mmserve ingress serving %s from %s", self.server.model_name, self.config.model_dir)

    async def _parse(self, request: Request, model: type[BaseModel]) -> Any:
        limit = self.config.limits.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise OpenAIError(f"request body exceeds {limit} bytes", status=413)
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise OpenAIError(f"request body exceeds {limit} bytes", status=413)
        try:
            return model.model_validate_json(bytes(body))
        except ValidationError as exc:
            message, param = _validation_message(exc)
            raise bad_request(message, param) from None

    @staticmethod
    def _respond(result: Any) -> Any:
        if isinstance(result, AsyncIterator):
            return StreamingResponse(result, media_type="text/event-stream")
        return JSONResponse(result.model_dump(exclude_none=True))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        return self._respond(await self.server.chat(await self._parse(request, ChatCompletionRequest)))

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return self._respond(await self.server.completion(await self._parse(request, CompletionRequest)))

    @api.get("/v1/models")
    async def models(self) -> Any:
        return JSONResponse((await self.server.models()).model_dump(exclude_none=True))

    def pid(self) -> int:
        return os.getpid()

    @api.get("/health")
    async def health(self) -> Any:
        infos = await self.router.infos()
        engines = [
            {"state": i.state if i else "unreachable", "builtin": i.builtin if i else None,
             "reason": i.death_reason if i else None, "in_flight": i.num_in_flight if i else None}
            for i in infos
        ]
        healthy = any(e["state"] == "ready" for e in engines)
        return JSONResponse({"status": "ok" if healthy else "unavailable", "engines": engines}, status_code=200 if healthy else 503)

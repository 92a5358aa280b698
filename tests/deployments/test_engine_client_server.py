"""The engine-client deployment's plain class, without Ray: it starts its built-in engine, serves, reports, refuses past its limit."""

from __future__ import annotations

import asyncio
import dataclasses

from deployments.engine_client import BuiltinEngineOptions, EngineClientServer, EngineClientSettings
from mmserve.builtin_engine.settings import DEFAULT_MODEL_DIR
from mmserve.engine import EngineAddresses
from mmserve.wire import EngineCoreRequest, SamplingParams


def _request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2, 3], None, SamplingParams(max_tokens=4, temperature=0.0), None, 0.0, None, None, None)


def test_serves_reports_and_refuses_past_its_in_flight_limit():
    async def run():
        settings = EngineClientSettings(
            addresses=EngineAddresses("tcp://127.0.0.1:0"), handshake_timeout_s=120.0, engine_wait_timeout_s=120.0,
            builtin_engine=BuiltinEngineOptions(model_dir=DEFAULT_MODEL_DIR, max_model_len=256),
        )
        server = EngineClientServer(settings)
        await server.start()
        try:
            events = [event async for event in server.generate(_request("a"))]
            tokens = [t for e in events for o in e.outputs for t in o.new_token_ids]
            info = await server.info()
            server.config = dataclasses.replace(settings, max_in_flight=0)
            refused = [event async for event in server.generate(_request("b"))]
            return tokens, info, refused
        finally:
            await server.shutdown()

    tokens, info, refused = asyncio.run(run())
    assert len(tokens) == 4
    assert (info.state, info.builtin, info.max_model_len, info.requests_sent) == ("ready", True, 256, 1)
    assert info.builtin_pid is not None
    assert len(refused) == 1 and refused[0].refused.kind == "overloaded"

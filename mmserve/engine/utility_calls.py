"""Utility calls in flight: vLLM's UTILITY message calls an EngineCore method by name; its answer
comes back among the engine's outputs, matched by call id."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

from ..wire import RequestEncoder, UtilityOutput
from .errors import EngineError


class UtilityCalls:
    def __init__(self, send: Callable[[list], Awaitable[None]]) -> None:
        self._send = send
        self._encoder = RequestEncoder()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count(1)

    async def call(self, method: str, args: tuple[Any, ...], timeout_s: float | None) -> Any:
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            await self._send(self._encoder.encode_utility(0, call_id, method, args))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._pending.pop(call_id, None)

    def answered(self, utility: UtilityOutput) -> None:
        future = self._pending.get(utility.call_id)
        if future is None or future.done():
            return  # answered after its caller gave up
        if utility.failure_message is not None:
            future.set_exception(EngineError(f"utility call failed: {utility.failure_message}"))
        else:
            future.set_result(utility.value)

    def fail_all(self, error: EngineError) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)

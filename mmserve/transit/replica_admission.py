"""How many image requests a preprocessor replica works on at once, and how many it lets wait.

Its requests come over the preprocessing link (`preprocessing_server.py`) and as Serve calls, so
Serve's own per-replica limit, which counts the link's long-lived subscriptions as requests, cannot
be the one: the replica admits every request itself, `max_ongoing` at a time, `max_queued` more
waiting their turn in arrival order, and refuses the rest at once as busy (a 503 with Retry-After).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ..multimodal.errors import PreprocessorBusyError

QUEUE_FULL_MESSAGE = "the image preprocessing queue is full; retry shortly"


class ReplicaAdmission:
    def __init__(self, max_ongoing: int, max_queued: int) -> None:
        if max_ongoing < 1 or max_queued < 0:
            raise ValueError(f"max_ongoing must be ≥ 1 and max_queued ≥ 0, got {max_ongoing}, {max_queued}")
        self.max_ongoing = max_ongoing
        self.max_queued = max_queued
        self.ongoing = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def load(self) -> int:
        """Requests working or waiting here (what the replica reports for autoscaling)."""
        return self.ongoing + len(self._waiting)

    @asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        """Hold one of the `max_ongoing` places while inside; raises `PreprocessorBusyError` at once
        if `max_queued` requests are waiting for one already."""
        if self.ongoing >= self.max_ongoing or self._waiting:
            if len(self._waiting) >= self.max_queued:
                raise PreprocessorBusyError(QUEUE_FULL_MESSAGE)
            turn = asyncio.get_running_loop().create_future()
            self._waiting.append(turn)
            try:
                await turn  # its place is handed over by the request leaving it (below)
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._leave()  # handed a place in the same instant: pass it on
                else:
                    self._waiting.remove(turn)
                raise
        else:
            self.ongoing += 1
        try:
            yield
        finally:
            self._leave()

    def _leave(self) -> None:
        """Give the place up: to the first waiting request, if any."""
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # `ongoing` unchanged: the place changes hands
                return
        self.ongoing -= 1

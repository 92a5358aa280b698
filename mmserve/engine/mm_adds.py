"""ADD messages, and the multimodal items in them: an item the engine holds in its multimodal
cache goes by hash only (the sender's mirror of that cache, `mm_cache.py`), and a request whose
items the engine reports missing (the mirror drifted) is resent once with all its data.

One per engine client; the mirror is made anew at each handshake (a restarted engine starts
empty). ADDs carrying items go out in the order the mirror was updated in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec

from ..wire import EngineCoreRequest, RequestEncoder
from .errors import EngineError
from .mm_cache import SenderCacheMirror, carries_data_for, feature_key

logger = logging.getLogger(__name__)


class EngineAdds:
    def __init__(self, send: Callable[[list], Awaitable[None]]) -> None:
        self._send = send
        self._encoder = RequestEncoder()
        # The engine's multimodal item cache, as far as this sender knows (None: send full data).
        self.mirror: SenderCacheMirror | None = None
        self._lock = asyncio.Lock()
        self._resends: set[asyncio.Task[None]] = set()
        # ADDs sent since start (observability: cancellation tests, metrics); items sent by hash
        # only; requests resent after the engine reported items missing (`mm_cache_miss_hashes`).
        self.requests_sent = 0
        self.items_skipped = 0
        self.cache_miss_resends = 0

    async def send(self, request: EngineCoreRequest, *, force_data: bool = False) -> None:
        mirror = self.mirror
        if mirror is None or not request.mm_features:
            await self._send(self._encoder.encode_add(request))
            self.requests_sent += 1
            return
        async with self._lock:
            features = mirror.prepare(request.mm_features, force_data=force_data)
            try:
                await self._send(self._encoder.encode_add(msgspec.structs.replace(request, mm_features=features)))
            except BaseException:
                # The engine may not have these items: never send them by hash on our word alone.
                for feature in request.mm_features:
                    mirror.invalidate(feature_key(feature))
                raise
        self.requests_sent += 1
        self.items_skipped += sum(1 for f in features if f.data is None)

    def resend_on_cache_miss(
        self, request: EngineCoreRequest, missing: list[str] | None, fail: Callable[[str, EngineError], None]
    ) -> bool:
        """If the engine lost items of `request` that were sent by hash, resend it (in the
        background), every item with its data, and say so; `fail(request_id, error)` if that fails.
        The caller resends a request once at most."""
        if not missing or not carries_data_for(request.mm_features, missing):
            return False
        self.cache_miss_resends += 1
        logger.warning("request %s: engine misses cached items %s; resending with data", request.request_id, missing)
        if self.mirror is not None:
            for key in missing:
                self.mirror.invalidate(key)
        task = asyncio.get_running_loop().create_task(self._resend(request, fail), name=f"resend-{request.request_id}")
        self._resends.add(task)
        task.add_done_callback(self._resends.discard)
        return True

    async def _resend(self, request: EngineCoreRequest, fail: Callable[[str, EngineError], None]) -> None:
        try:
            await self.send(request, force_data=True)
        except EngineError as exc:
            fail(request.request_id, exc)
        except Exception as exc:
            fail(request.request_id, EngineError(f"resending the request failed: {exc}"))

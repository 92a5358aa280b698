"""ADD messages, and the multimodal items in them: an item the engine holds in its multimodal
cache goes by hash only (the sender's mirror of that cache, `mm_cache.py`), and a request whose
items the engine reports missing (the mirror drifted) is resent once with all its data.

A caller may send items by hash only itself (it knows their hashes, not their data, from an earlier
request) if it can get their data back (`Refill`): a request whose data-less items the mirror does
not hold when it is sent (evicted meanwhile) is refilled first, and one whose items the engine reports
missing is refilled and resent.

One per engine client; the mirror is made anew at each handshake (a restarted engine starts
empty). ADDs carrying items go out in the order the mirror was updated in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeAlias

import msgspec

from ..wire import EngineCoreRequest, RequestEncoder
from .errors import EngineError
from .mm_cache import SenderCacheMirror, carries_data_for, feature_key

logger = logging.getLogger(__name__)

# The request again, every item with its data (e.g. its images processed anew): for a request whose
# items were sent, or were to be sent, by hash only when the engine does not hold them.
Refill: TypeAlias = Callable[[], Awaitable[EngineCoreRequest]]


class EngineAdds:
    def __init__(self, send: Callable[[list], Awaitable[None]], in_flight: Callable[[str], bool]) -> None:
        self._send = send
        # Whether a request is still the engine's (not aborted, not finished): else it is not resent.
        self._in_flight = in_flight
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

    async def send(self, request: EngineCoreRequest, *, force_data: bool = False, refill: Refill | None = None) -> EngineCoreRequest:
        """Send `request` (its items by hash where the engine holds them); returns it as sent (with
        `refill`: refilled first if the engine might not hold an item it carries without data)."""
        if not request.mm_features or (self.mirror is None and refill is None):
            await self._send_prepared(request, force_data)  # (no mirror to update in wire order: no lock)
            return request
        async with self._lock:
            if refill is None or self.holds(feature_key(f) for f in request.mm_features if f.data is None):
                await self._send_prepared(request, force_data)
                return request
        # An item went since the caller chose to send it by hash: its data first (not under the
        # lock: other requests go on meanwhile), then as any request with data.
        request = await refill()
        return await self.send(request, force_data=force_data)

    def holds(self, keys: Iterable[str]) -> bool:
        """Whether the engine holds every one of these items, as far as the mirror knows."""
        mirror = self.mirror
        return all(mirror is not None and key in mirror for key in keys)

    async def _send_prepared(self, request: EngineCoreRequest, force_data: bool) -> None:
        mirror = self.mirror
        if mirror is None or not request.mm_features:
            await self._send(self._encoder.encode_add(request))
            self.requests_sent += 1
            return
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
        self, request: EngineCoreRequest, missing: list[str] | None, fail: Callable[[str, EngineError], None],
        refill: Refill | None = None,
    ) -> bool:
        """If the engine lost items of `request` that were sent by hash, resend it (in the
        background), every item with its data (from `refill` if `request` lacks it), and say so;
        `fail(request_id, error)` if that fails. The caller resends a request once at most."""
        if not missing:
            return False
        has_data = carries_data_for(request.mm_features, missing)
        if not has_data and refill is None:
            return False
        self.cache_miss_resends += 1
        logger.warning("request %s: engine misses cached items %s; resending with data", request.request_id, missing)
        if self.mirror is not None:
            for key in missing:
                self.mirror.invalidate(key)
        resend = self._resend(request, fail, None if has_data else refill)
        task = asyncio.get_running_loop().create_task(resend, name=f"resend-{request.request_id}")
        self._resends.add(task)
        task.add_done_callback(self._resends.discard)
        return True

    async def _resend(self, request: EngineCoreRequest, fail: Callable[[str, EngineError], None], refill: Refill | None) -> None:
        try:
            if refill is not None:
                request = await refill()
            if self._in_flight(request.request_id):  # (not aborted meanwhile)
                await self.send(request, force_data=True)
        except EngineError as exc:
            fail(request.request_id, exc)
        except Exception as exc:
            fail(request.request_id, EngineError(f"resending the request failed: {exc}"))

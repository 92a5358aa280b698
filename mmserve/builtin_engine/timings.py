"""Per-request wall times the built-in engine keeps for benchmarks (the `get_request_timings` utility).

For each request: the ADD's `arrival_time` (stamped by the front-end), when the ADD was decoded
here, and when each output frame was sent. Bounded: the last `TIMINGS_MAX_REQUESTS` requests,
the first `TIMINGS_MAX_FRAMES` frames of each (≤ 10k × 512 × 2 doubles ≈ 80 MB in the worst
case, a few MB for ordinary requests).
"""

from __future__ import annotations

import array
import collections
from typing import Any

TIMINGS_MAX_REQUESTS = 10_000
TIMINGS_MAX_FRAMES = 512


class RequestTimings:
    """Wall times (`time.time()`) of one request, for `get_request_timings`."""

    __slots__ = ("request_id", "arrival_time", "received", "sent", "num_tokens")

    def __init__(self, request_id: str, arrival_time: float, received: float) -> None:
        self.request_id = request_id
        self.arrival_time = arrival_time  # stamped by the front-end (EngineCoreRequest.arrival_time)
        self.received = received  # the ADD decoded by this engine
        self.sent = array.array("d")  # each output frame of this request, just before its send
        self.num_tokens = array.array("i")  # new tokens in that frame

    def record(self, when: float, num_tokens: int) -> None:
        if len(self.sent) < TIMINGS_MAX_FRAMES:
            self.sent.append(when)
            self.num_tokens.append(num_tokens)

    def as_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "arrival_time": self.arrival_time,
            "received": self.received,
            "sent": self.sent.tolist(),
            "num_tokens": self.num_tokens.tolist(),
        }


class TimingsLog:
    """The recorded requests, insertion-ordered; the oldest are dropped beyond TIMINGS_MAX_REQUESTS."""

    def __init__(self) -> None:
        self._timings: collections.OrderedDict[str, RequestTimings] = collections.OrderedDict()

    def start(self, request_id: str, arrival_time: float, received: float) -> None:
        self._timings.pop(request_id, None)
        self._timings[request_id] = RequestTimings(request_id, arrival_time, received)
        while len(self._timings) > TIMINGS_MAX_REQUESTS:
            self._timings.popitem(last=False)

    def record(self, request_id: str, when: float, num_tokens: int) -> None:
        if (timings := self._timings.get(request_id)) is not None:
            timings.record(when, num_tokens)

    def query(self, request_ids: list[str] | None = None, clear: bool = False) -> list[dict[str, Any]]:
        """Timings of the recorded requests (oldest first), or of `request_ids` only.

        Each: request_id, arrival_time (front-end's stamp), received (ADD decoded here), sent
        (wall time of each output frame, just before its send) and num_tokens (per frame).
        `clear` forgets everything recorded so far.
        """
        if request_ids is None:
            result = [t.as_dict() for t in self._timings.values()]
        else:
            result = [self._timings[r].as_dict() for r in request_ids if r in self._timings]
        if clear:
            self._timings.clear()
        return result

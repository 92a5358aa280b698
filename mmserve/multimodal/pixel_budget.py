"""The pixel budget of one preprocessor replica: decoded pixels in flight, admitted per request.

Decoding is where an image request's memory goes: a replica decoding 50 MP images for all
its `max_ongoing_requests` at once would need gigabytes (decode to RGB, then the exact resize's
intermediates hold several times the source's pixels). A request's demand is known from the
image headers before anything is decoded, so a request is admitted only if its demand fits
beside what the replica is decoding already; otherwise it is refused at once (503, the client
retries, possibly on another replica) rather than queued holding its fetched bytes.
"""

from __future__ import annotations

import threading

# A busy replica frees its budget as its current images finish (seconds for the largest).
BUSY_RETRY_AFTER_S = 1


class PixelBudget:
    """Pixels being decoded in one replica, bounded by `limit`.

    Acquired and released in the worker threads that decode (a request's pixel work outlives
    its coroutine when the client goes away), hence the lock.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"a pixel budget must be positive, got {limit}")
        self.limit = limit
        self._lock = threading.Lock()
        self.in_use = 0
        self.peak = 0
        self.refused = 0

    def fits_alone(self, pixels: int) -> bool:
        """Whether a demand of `pixels` can ever be admitted (on an idle replica)."""
        return pixels <= self.limit

    def try_acquire(self, pixels: int) -> bool:
        """Take `pixels` if they fit beside the pixels in flight now; never waits."""
        with self._lock:
            if self.in_use + pixels > self.limit:
                self.refused += 1
                return False
            self.in_use += pixels
            self.peak = max(self.peak, self.in_use)
            return True

    def release(self, pixels: int) -> None:
        with self._lock:
            self.in_use -= pixels

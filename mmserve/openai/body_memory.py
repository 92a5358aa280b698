"""What request bodies cost an ingress replica's memory: the byte budget they are admitted by,
and giving their memory back to the OS once they are gone (glibc).

Plain classes, testable without Ray or HTTP; `intake.py` charges the budget as a body is read
and parsed, the ingress deployment releases it.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable

from .errors import OpenAIError

# Bytes a body costs the replica while it is parsed: the body itself and what pydantic makes of
# it (strings of about the same size). Image payloads are charged the same until the preprocessor
# has them: the strings, and their serialised copy for the Ray call.
PARSE_CHARGE_PER_BYTE = 2


class ByteBudget:
    """Bytes of request bodies (and their parsed forms) held by one ingress replica.

    Bodies up to `small_bytes` always pass: the budget guards against a few large requests
    taking the replica's memory, not against many ordinary ones (Serve's `max_ongoing_requests`
    bounds those). A large body that could never fit is refused with 413 naming the limit; one
    that does not fit now, with 503 and `Retry-After` (waiting helps: other bodies leave).
    Single-threaded (the replica's event loop), so no lock.
    """

    def __init__(self, limit_bytes: int, small_bytes: int, after_large: Callable[[], None] | None = None) -> None:
        self.limit = limit_bytes
        self.small = small_bytes
        self.used = 0
        self.refused = 0
        self.after_large = after_large  # called when a large body's share is given back

    def lease(self) -> "BudgetLease":
        return BudgetLease(self)

    def never_fits(self, body_bytes: int) -> OpenAIError:
        return OpenAIError(
            f"a request body of {body_bytes} bytes can never be admitted: parsing it takes "
            f"{PARSE_CHARGE_PER_BYTE * body_bytes} bytes of the replica's body budget of {self.limit} "
            "(limits.ingress_body_budget_bytes)",
            status=413, code="request_too_large",
        )

    def busy(self) -> OpenAIError:
        self.refused += 1
        return OpenAIError(
            "the server is busy with other large requests; retry shortly",
            status=503, code="server_busy", retry_after_s=1,
        )


class BudgetLease:
    """One request's share of the budget: what it holds now, changed as its bytes come and go.

    While the body is read: the bytes received (a slow body holds what it has sent, not what it
    declared); while it is parsed: twice the body; then twice its image payloads until the
    preprocessor has them (`release()`), nothing for text. Generation holds nothing.
    """

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self.held = 0
        self.large = False  # a body past the budget's small size: refusable, trimmed after

    def admit(self, body_bytes: int) -> None:
        """Refuse a body of `body_bytes` now if it could never fit (413) or does not fit now
        (503); holds nothing."""
        if body_bytes > self.budget.small:
            self._check(PARSE_CHARGE_PER_BYTE * body_bytes, body_bytes)

    def hold(self, amount: int, body_bytes: int) -> None:
        """Hold `amount` bytes for a body of `body_bytes` (more or fewer than now). Growing past
        the budget refuses a large body (413 if it never could fit, else 503); shrinking never fails."""
        budget = self.budget
        if body_bytes > budget.small:
            self.large = True
            if amount > self.held:
                self._check(amount, body_bytes)
        budget.used += amount - self.held
        self.held = amount

    def _check(self, amount: int, body_bytes: int) -> None:
        """413 if parsing the body could never fit the budget, 503 if `amount` does not fit beside
        what the other requests hold now."""
        budget = self.budget
        if PARSE_CHARGE_PER_BYTE * body_bytes > budget.limit:
            raise budget.never_fits(body_bytes)
        if budget.used - self.held + amount > budget.limit:
            raise budget.busy()

    def release(self) -> None:
        """Give everything back (idempotent)."""
        budget = self.budget
        budget.used -= self.held
        self.held = 0
        if self.large:
            self.large = False
            if budget.after_large is not None:
                budget.after_large()


def _glibc() -> ctypes.CDLL | None:
    libc_name = ctypes.util.find_library("c")
    return ctypes.CDLL(libc_name) if libc_name else None


def _glibc_malloc_trim() -> Callable[[], object] | None:
    trim = getattr(_glibc(), "malloc_trim", None)  # glibc only (not musl, not macOS)
    return None if trim is None else (lambda: trim(0))


# glibc's mallopt parameter for the size from which blocks get their own mapping.
_M_MMAP_THRESHOLD = -3


def map_large_blocks_separately(threshold_bytes: int = 128 * 1024) -> bool:
    """Blocks from `threshold_bytes` up get their own mapping, given back to the OS when freed.

    glibc's default threshold grows to the size of the largest block freed (up to 32 MiB), so
    after one large body the next ones are carved from the heap, where freed memory stays. Setting
    it also turns glibc's growth off. False where this is not glibc.
    """
    mallopt = getattr(_glibc(), "mallopt", None)
    return bool(mallopt is not None and mallopt(_M_MMAP_THRESHOLD, threshold_bytes))


class HeapTrimmer:
    """Gives the heap memory a large body leaves behind back to the OS, shortly after it is freed.

    glibc keeps freed memory in its arenas, and a freed 30 MB body raises its mmap threshold so that
    the next ones are carved from the heap too, where freed memory stays. `malloc_trim(0)` takes
    time in proportion to what it frees, so requests coalesce into at most one call per `delay_s`,
    on the event loop (the last request is always followed by a call).
    """

    def __init__(self, delay_s: float = 0.5, trim: Callable[[], object] | None = None) -> None:
        self.delay_s = delay_s
        self._trim = trim if trim is not None else _glibc_malloc_trim()
        self._pending: asyncio.TimerHandle | None = None
        self.trims = 0

    def request(self) -> None:
        if self._trim is None or self._pending is not None:
            return
        self._pending = asyncio.get_running_loop().call_later(self.delay_s, self._run)

    def _run(self) -> None:
        self._pending = None
        self.trims += 1
        self._trim()

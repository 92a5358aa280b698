"""Callers that died, noticed by actor name: an engine client's (ingress replicas), so their requests
stop; a preprocessor replica's (engine clients), so their attachments end."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger("ray.serve")


class CallerWatch:
    """Notices callers (replicas that call this one) that died, and calls `on_gone` for each.

    Ray does not stop an actor's streaming generator when the process consuming it dies, so
    without this the requests of an ingress that was killed would run to `max_tokens` for
    nobody, and a dead engine client's attachment to a preprocessor replica would stay open. Callers are looked up by actor name once per `interval_s` while any is watched; a
    name that no longer resolves is a dead replica.
    """

    def __init__(
        self, on_gone: Callable[[str], Awaitable[None]], interval_s: float = 1.0, consequence: str = "cancelling its requests"
    ) -> None:
        self.on_gone = on_gone
        self.interval_s = interval_s
        self.consequence = consequence
        self._callers: set[str] = set()
        self._loop: asyncio.Task[None] | None = None

    def watch(self, caller: str) -> None:
        if not caller:
            return  # not a replica (a driver or a test): nothing to look up
        self._callers.add(caller)
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._run(), name="caller-watch")

    def unwatch(self, caller: str) -> None:
        self._callers.discard(caller)

    async def _run(self) -> None:
        while self._callers:
            await asyncio.sleep(self.interval_s)
            for caller in list(self._callers):
                if await asyncio.to_thread(_actor_alive, caller):
                    continue
                self._callers.discard(caller)
                logger.warning("caller %s is gone: %s", caller, self.consequence)
                await self.on_gone(caller)


def _actor_alive(name: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace="serve")
    except ValueError:  # no live actor by that name
        return False
    except Exception:  # GCS unreachable or the like: assume alive rather than cancel
        return True
    return True


class HeldCalls:
    """Calls held open for as long as their callers live (a preprocessor replica's attachments,
    `PreprocessorDeployment.subscribe`): Ray ends none of them when the caller dies, so each
    waits in `until_gone` until its caller is found dead (`CallerWatch`)."""

    def __init__(self, consequence: str, interval_s: float = 1.0) -> None:
        self._ends: dict[str, set[asyncio.Event]] = {}
        self._watch = CallerWatch(self._gone, interval_s, consequence)

    async def until_gone(self, caller: str) -> None:
        """Return when `caller` (an actor name; "" for none: never) is dead."""
        end = asyncio.Event()
        if caller:
            self._ends.setdefault(caller, set()).add(end)
            self._watch.watch(caller)
        try:
            await end.wait()
        finally:
            ends = self._ends.get(caller)
            if ends is not None:
                ends.discard(end)
                if not ends:
                    del self._ends[caller]
                    self._watch.unwatch(caller)

    async def _gone(self, caller: str) -> None:
        for end in self._ends.pop(caller, set()):
            end.set()

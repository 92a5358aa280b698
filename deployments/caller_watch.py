"""Callers of an engine client (ingress replicas) that died, noticed by actor name, so their requests stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger("ray.serve")


class CallerWatch:
    """Notices callers (ingress replicas) that died, and calls `on_gone` for each.

    Ray does not stop an actor's streaming generator when the process consuming it dies, so
    without this the requests of an ingress that was killed would run to `max_tokens` for
    nobody. Callers are looked up by actor name once per `interval_s` while any is watched; a
    name that no longer resolves is a dead replica.
    """

    def __init__(self, on_gone: Callable[[str], Awaitable[None]], interval_s: float = 1.0) -> None:
        self.on_gone = on_gone
        self.interval_s = interval_s
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
                logger.warning("caller %s is gone: cancelling its requests", caller)
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

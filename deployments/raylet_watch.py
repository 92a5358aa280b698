"""Noticing, within a fraction of a second, that this Ray worker's raylet is gone (its node left the cluster).

A Ray worker is a child process of its node's raylet. When the raylet dies (the node is lost, or
only its raylet was killed), Ray ends the worker by itself, but only after its own periodic checks,
some seconds: an engine client replica streams to its callers all the while, and the engine it
launched outlives it for good. The processes on
that node keep running; nothing there can be scheduled, reached through Ray, or cleaned up by it.

`RayletWatch` looks at this process's parent every `interval_s` from a thread of its own (not
an event loop: the check must run while the loop is busy) and calls `on_lost` once when the
parent is no longer the raylet it started under: the kernel re-parents an orphan at once, so
`getppid()` changing is the raylet's exit, not a guess from a timeout.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger("ray.serve")

RAYLET_PROCESS_NAME = "raylet"


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


class RayletWatch:
    """Calls `on_lost` once, from its own daemon thread, when this process's parent (its raylet)
    exits. `parent_name` is the parent's process name (`/proc/PID/comm`) the watch expects: under
    any other parent (not a Ray worker, or one Ray started some other way) it does not start."""

    def __init__(
        self, on_lost: Callable[[], None], *, interval_s: float = 0.2, parent_name: str = RAYLET_PROCESS_NAME
    ) -> None:
        self._on_lost = on_lost
        self._interval_s = interval_s
        self._parent_name = parent_name
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Start watching; False (and no thread) if this process's parent is not a `parent_name`."""
        parent = os.getppid()
        if _process_name(parent) != self._parent_name:
            logger.debug("raylet watch not started: parent %d is %r", parent, _process_name(parent))
            return False
        self._thread = threading.Thread(target=self._run, args=(parent,), daemon=True, name="raylet-watch")
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stopped.set()

    def _run(self, parent: int) -> None:
        while not self._stopped.wait(self._interval_s):
            if os.getppid() != parent:
                self._on_lost()
                return

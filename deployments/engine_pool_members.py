"""Which replicas a deployment has, as this process's Serve routers last heard: a `NamedReplicaRouter`
(`replica_router.py`: the engine pool's, the preprocessor's) writes it, the callers read it (the
ingress's `EnginePoolMembers`, an engine client's preprocessing links).

Its own module because Serve pickles the request router's module by value into each caller (a copy
whose globals are not this process's): state shared with the callers must live elsewhere.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

# (application, deployment) → the unique ids of its running replicas, as last broadcast.
_members: dict[tuple[str, str], tuple[str, ...]] = {}
# (application, deployment) → what to call (on the router's thread) when its list changes.
_watchers: dict[tuple[str, str], list[Callable[[], None]]] = {}
# Serve's routers may run on a loop thread of their own.
_lock = threading.Lock()


def publish_members(app_name: str, deployment_name: str, replica_ids: tuple[str, ...]) -> None:
    with _lock:
        _members[(app_name, deployment_name)] = replica_ids
        watchers = list(_watchers.get((app_name, deployment_name), ()))
    for watcher in watchers:
        watcher()


def pool_members(app_name: str, deployment_name: str) -> tuple[str, ...] | None:
    """The deployment's replicas (their unique ids); None: no router here has heard of them yet."""
    with _lock:
        return _members.get((app_name, deployment_name))


def watch_members(app_name: str, deployment_name: str, watcher: Callable[[], None]) -> None:
    """Call `watcher` (on whichever thread the router runs: it must be thread-safe) whenever the
    deployment's replica list is published."""
    with _lock:
        _watchers.setdefault((app_name, deployment_name), []).append(watcher)

"""Which replicas an engine pool has, as this process's Serve routers last heard: the pool's request
router writes it, the ingress's `EnginePoolMembers` reads it.

Its own module because Serve pickles the request router's module by value into each caller (a copy
whose globals are not this process's): state shared with the ingress must live elsewhere.
"""

from __future__ import annotations

import threading

# (application, deployment) → the unique ids of its running replicas, as last broadcast.
_members: dict[tuple[str, str], tuple[str, ...]] = {}
# Serve's routers may run on a loop thread of their own.
_lock = threading.Lock()


def publish_members(app_name: str, deployment_name: str, replica_ids: tuple[str, ...]) -> None:
    with _lock:
        _members[(app_name, deployment_name)] = replica_ids


def pool_members(app_name: str, deployment_name: str) -> tuple[str, ...] | None:
    """The pool's replicas (their unique ids); None: no router here has heard of them yet."""
    with _lock:
        return _members.get((app_name, deployment_name))

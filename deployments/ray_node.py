"""This Ray worker's node address, where the processes on other nodes reach its ZMQ links."""

from __future__ import annotations


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()

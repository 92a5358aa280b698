"""Where this Ray worker is: its node's address, where the processes on other nodes reach its ZMQ
links, and, in a Serve replica, the replica's ids."""

from __future__ import annotations


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def replica_ids() -> tuple[str, str]:
    """This replica's full id (its actor's name: how callers name themselves) and unique id (how a
    `NamedReplicaRouter` call names its replica); both empty outside a replica (tests, drivers)."""
    from ray import serve

    try:
        replica_id = serve.get_replica_context().replica_id
    except Exception:  # not in a replica
        return "", ""
    return replica_id.to_full_id_str(), replica_id.unique_id

"""ZMQ address checks for tests."""

from __future__ import annotations

import time

import zmq


def assert_bindable_soon(address: str, within_s: float = 1.0) -> None:
    """`address` can be bound again within `within_s`: a closed socket's addresses are unbound by
    zmq's I/O thread just after the close, not by the close itself."""
    sock = zmq.Context.instance().socket(zmq.PULL)
    deadline = time.monotonic() + within_s
    try:
        while True:
            try:
                sock.bind(address)
                return
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
    finally:
        sock.close(linger=0)

"""An engine transport's output messages as a queue, for tests that read them one at a time."""

from __future__ import annotations

import asyncio

from mmserve.engine.transport import EngineTransport


def output_queue(transport: EngineTransport) -> asyncio.Queue[list[bytes]]:
    """Every message the engine sends on `transport` from now on, in order (call on its event loop)."""
    queue: asyncio.Queue[list[bytes]] = asyncio.Queue()
    transport.read_outputs(queue.put_nowait)
    return queue

"""How an engine client learns that its engine is gone: the TCP connection drops (a killed
process), or a cheap utility call goes unanswered for `health_check_timeout_s` while nothing else
arrives from the engine either (a hung process).
An engine that says so itself (`ENGINE_CORE_DEAD`) is noticed by the output loop.

Two loops, each ending when the engine is declared dead; what dying means is the client's
(`EngineClient._declare_dead`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .errors import EngineError

logger = logging.getLogger(__name__)


async def watch_disconnect(monitor: zmq.asyncio.Socket, declare_dead: Callable[[str], None]) -> None:
    """Until the engine's connection drops (the transport's socket monitor says so)."""
    while True:
        event = parse_monitor_message(await monitor.recv_multipart())
        if event["event"] == zmq.EVENT_DISCONNECTED:
            declare_dead("engine connection lost (process exited or network failed)")
            return


async def probe_health(
    call_utility: Callable[..., Awaitable[Any]],
    is_ready: Callable[[], bool],
    declare_hung: Callable[[str], None],
    last_heard: Callable[[], float],
    interval_s: float,
    timeout_s: float,
) -> None:
    """Every `interval_s`, a utility call the engine answers between steps (`is_sleeping`); no answer
    within `timeout_s`, and no frame at all from the engine in that time (`last_heard`: the monotonic
    time of the last one), declares it hung. An answer with a failure still proves it alive.

    The answer comes on the output socket behind the outputs the engine sent before it: a client that
    lags behind a fast engine (a loaded gateway on few cores) reads it late although the engine is
    well, and the outputs it reads meanwhile prove that, as do outputs that wait unread when the
    client's own loop was stalled (`EngineTransport.last_heard`). A hung engine sends nothing: once
    the outputs already sent are read, the next health check declares it."""
    while is_ready():
        await asyncio.sleep(interval_s)
        started = time.monotonic()
        try:
            await call_utility("is_sleeping", timeout_s=timeout_s)
        except TimeoutError:
            if not is_ready():
                return
            if time.monotonic() - last_heard() < timeout_s:
                logger.debug("engine health check unanswered within %.1f s, but the engine's outputs still arrive", timeout_s)
                continue
            declare_hung(f"engine did not answer a health check within {timeout_s:.1f} s (hung?)")
            return
        except EngineError as exc:
            if not is_ready():
                return
            logger.warning("engine health check answered with an error: %s", exc)
            continue
        logger.debug("engine health check answered in %.1f ms", (time.monotonic() - started) * 1e3)

"""`probe_health`: an engine that answers no health check and sends nothing is declared hung; one whose
answer is late while its outputs keep arriving (a client lagging behind a fast engine) is not, until
its outputs stop too."""

from __future__ import annotations

import asyncio
import time

from mmserve.engine.liveness import probe_health
from tests.support.engine_outputs import output_queue

INTERVAL_S, TIMEOUT_S = 0.05, 0.2


async def _unanswered(method: str, timeout_s: float) -> None:
    await asyncio.sleep(timeout_s)
    raise TimeoutError


def _probe(last_heard, call_utility=_unanswered):
    declared: list[tuple[float, str]] = []
    task = asyncio.ensure_future(probe_health(
        call_utility, lambda: not declared, lambda reason: declared.append((time.monotonic(), reason)),
        last_heard, INTERVAL_S, TIMEOUT_S,
    ))  # fmt: skip
    return task, declared


def test_silent_engine_is_declared_hung_within_interval_and_timeout():
    """The first unanswered health check declares it: one interval and one timeout. Counted in
    checks, not bounded tightly in wall time: a full run's load delays each sleep by a varying
    amount (0.445 s against a bound of 0.40 once, 2026-12-06)."""
    calls: list[float] = []

    async def unanswered(method: str, timeout_s: float) -> None:
        calls.append(timeout_s)
        await _unanswered(method, timeout_s)

    async def main():
        start = time.monotonic()
        task, declared = _probe(lambda: 0.0, unanswered)
        await asyncio.wait_for(task, 2)
        assert len(declared) == 1 and "did not answer a health check within 0.2 s" in declared[0][1]
        assert calls == [TIMEOUT_S]  # one check, waited for its whole timeout
        assert INTERVAL_S + TIMEOUT_S - 0.01 <= declared[0][0] - start < 1.0  # (asyncio may wake ≈1 ms early)

    asyncio.run(main())


def test_outputs_arriving_keep_an_unanswering_engine_alive_until_they_stop():
    async def main():
        heard = {"at": time.monotonic()}
        task, declared = _probe(lambda: heard["at"])
        for _ in range(10):  # 1 s of outputs, five health-check timeouts
            await asyncio.sleep(0.1)
            heard["at"] = time.monotonic()
        stopped = time.monotonic()
        assert not declared
        await asyncio.wait_for(task, 2)
        assert len(declared) == 1
        assert TIMEOUT_S <= declared[0][0] - stopped < INTERVAL_S + 2 * TIMEOUT_S + 0.15

    asyncio.run(main())


def test_an_answering_engine_is_never_declared():
    async def answered(method: str, timeout_s: float) -> bool:
        return False

    async def main():
        task, declared = _probe(lambda: 0.0, answered)
        await asyncio.sleep(0.5)
        task.cancel()
        assert not declared

    asyncio.run(main())



def test_an_output_waiting_unread_counts_as_heard_now():
    """A client whose event loop was stalled (a loaded gateway) finds its health check timed out and
    the engine's outputs still unread: they prove the engine alive (a gateway stalled for longer than
    the timeout declared a well engine hung, in a full run of the suite)."""
    import zmq

    from mmserve.engine.transport import EngineAddresses, EngineTransport

    async def main():
        transport = EngineTransport(EngineAddresses("tcp://127.0.0.1:0"))
        engine = zmq.Context.instance().socket(zmq.PUSH)
        engine.connect(transport.output_address)
        try:
            assert transport.last_heard() == 0.0
            engine.send_multipart([b"output"])
            deadline = time.monotonic() + 2
            while transport.last_heard() == 0.0 and time.monotonic() < deadline:
                time.sleep(0.01)  # the event loop is blocked: nothing reads the output
            assert time.monotonic() - transport.last_heard() < 0.1
            assert await asyncio.wait_for(output_queue(transport).get(), 2) == [b"output"]
            read_at = time.monotonic()
            time.sleep(0.2)
            assert 0 <= read_at - transport.last_heard() < 0.1  # read, nothing waiting: when it was read
        finally:
            engine.close(linger=0)
            transport.close()

    asyncio.run(main())


def test_asking_whether_an_output_waits_does_not_swallow_the_readers_wake_up():
    """zmq's socket descriptor signals a change, not a message: reading `EVENTS` (as `last_heard` does)
    consumes that signal, and the reader waiting on the descriptor is then never woken unless
    `last_heard` wakes it itself."""
    import zmq

    from mmserve.engine.transport import EngineAddresses, EngineTransport

    async def main():
        transport = EngineTransport(EngineAddresses("tcp://127.0.0.1:0"))
        engine = zmq.Context.instance().socket(zmq.PUSH)
        engine.connect(transport.output_address)
        try:
            reader = asyncio.ensure_future(output_queue(transport).get())
            await asyncio.sleep(0.05)  # the reader waits on the loop
            engine.send_multipart([b"output"])
            deadline = time.monotonic() + 2
            while time.monotonic() - transport.last_heard() > 1 and time.monotonic() < deadline:
                time.sleep(0.01)  # asked before the loop runs again, as the health check may
            assert await asyncio.wait_for(reader, 2) == [b"output"]
        finally:
            engine.close(linger=0)
            transport.close()

    asyncio.run(main())

"""Calls held for callers end when their caller is found dead, and only then (`HeldCalls`)."""

from __future__ import annotations

import asyncio

import pytest

from deployments import caller_watch
from deployments.caller_watch import HeldCalls


@pytest.fixture
def alive(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The actor names the (faked) GCS lookup finds alive."""
    names: set[str] = set()
    monkeypatch.setattr(caller_watch, "_actor_alive", lambda name: name in names)
    return names


async def test_a_held_call_ends_when_its_caller_dies_and_the_others_stay(alive: set[str], caplog) -> None:
    alive.update({"engine-client-a", "engine-client-b"})
    held = HeldCalls("ending its attachment", interval_s=0.01)
    a1 = asyncio.create_task(held.until_gone("engine-client-a"))
    a2 = asyncio.create_task(held.until_gone("engine-client-a"))
    b = asyncio.create_task(held.until_gone("engine-client-b"))
    nobody = asyncio.create_task(held.until_gone(""))
    await asyncio.sleep(0.1)
    assert not any(t.done() for t in (a1, a2, b, nobody))

    alive.discard("engine-client-a")
    await asyncio.wait_for(asyncio.gather(a1, a2), 2)
    await asyncio.sleep(0.1)
    assert not b.done() and not nobody.done()
    assert "caller engine-client-a is gone: ending its attachment" in caplog.text
    for t in (b, nobody):
        t.cancel()


async def test_a_call_that_ends_first_stops_the_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    lookups = 0

    def counted(name: str) -> bool:
        nonlocal lookups
        lookups += 1
        return True

    monkeypatch.setattr(caller_watch, "_actor_alive", counted)
    held = HeldCalls("ending its attachment", interval_s=0.01)
    call = asyncio.create_task(held.until_gone("engine-client-a"))
    await asyncio.sleep(0.1)
    assert lookups > 0
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    await asyncio.sleep(0.05)
    after_end = lookups
    await asyncio.sleep(0.1)
    assert lookups == after_end  # nobody watched: no more lookups

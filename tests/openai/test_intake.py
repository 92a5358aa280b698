"""Request intake: byte caps, the byte budget, the data-URI scan and the count checks, refused
before the step they protect (plain classes, no Ray)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from mmserve.openai.errors import OpenAIError
from mmserve.openai.settings import ServingSettings
from serve_app.config import AppConfig
from serve_app.settings import serving_settings
from mmserve.openai.body_memory import PARSE_CHARGE_PER_BYTE, ByteBudget, HeapTrimmer
from mmserve.openai.intake import (
    BodyCaps,
    CountLimits,
    ShapeChecker,
    base64_chars,
    default_body_budget,
    read_body,
    scan_data_uris,
)

MiB = 1024 * 1024


def _config(**limits) -> ServingSettings:
    """The ingress's settings for this application config (the builder's translation)."""
    return serving_settings(AppConfig.model_validate({"limits": limits, "images": {"max_images_per_request": 2, "max_image_bytes": MiB}}))


def _caps(images_allowed: bool = True, **limits) -> BodyCaps:
    return BodyCaps.from_settings(_config(max_request_bytes=64 * 1024, **limits), images_allowed)


async def _chunks(body: bytes, size: int = 8192):
    for i in range(0, len(body), size):
        yield body[i : i + size]


def _read(body: bytes, caps: BodyCaps, *, images_route=True, declared: str | None = "auto", budget=None):
    budget = budget or ByteBudget(256 * MiB, 1024)
    if declared == "auto":
        declared = str(len(body))
    lease = budget.lease()
    return asyncio.run(read_body(_chunks(body), declared, caps, images_route, lease)), lease


def _status(exc_info) -> int:
    return exc_info.value.status


def test_caps_follow_the_configuration():
    caps = _caps()
    assert caps.text_bytes == 64 * 1024
    assert caps.max_data_uri_chars >= base64_chars(MiB)
    assert caps.cap(images=False) == 64 * 1024
    assert caps.cap(images=True) > 64 * 1024 + 2 * base64_chars(MiB)
    assert _caps(images_allowed=False).cap(images=True) == 64 * 1024


def test_declared_length_past_the_cap_is_refused_before_reading():
    caps = _caps()
    read = []

    async def never():
        read.append(1)
        yield b"x"

    with pytest.raises(OpenAIError) as exc:
        asyncio.run(read_body(never(), str(10 * MiB), caps, True, ByteBudget(256 * MiB, 1024).lease()))
    assert _status(exc) == 413 and exc.value.code == "request_too_large"
    assert read == []  # not one chunk was read


def test_streamed_text_body_past_the_text_cap_is_refused_even_without_content_length():
    body = json.dumps({"messages": [{"role": "user", "content": "a" * 100_000}]}).encode()
    with pytest.raises(OpenAIError) as exc:
        _read(body, _caps(), declared=None)
    assert _status(exc) == 413
    # The same size on the completions route (no image allowance).
    with pytest.raises(OpenAIError):
        _read(body, _caps(), images_route=False, declared=None)


def test_body_with_an_image_may_exceed_the_text_cap_but_not_outside_its_images():
    image = "data:image/png;base64," + "A" * 200_000
    ok = json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "hi"}]}]}).encode()
    body, _ = _read(ok, _caps(), declared=None)
    assert len(scan_data_uris(body, _caps())) == 1
    # 200 kB of text next to the image: refused by the scan, before any parsing.
    padded = json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "b" * 200_000}]}]}).encode()
    body, _ = _read(padded, _caps())
    with pytest.raises(OpenAIError) as exc:
        scan_data_uris(body, _caps())
    assert _status(exc) == 413


def test_data_uri_scan_refuses_too_many_and_too_long_images_before_decoding():
    caps = _caps()
    part = lambda n: {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * n}}  # noqa: E731
    three = json.dumps({"messages": [{"role": "user", "content": [part(8), part(8), part(8)]}]}).encode()
    with pytest.raises(OpenAIError) as exc:
        scan_data_uris(three, caps)
    assert exc.value.status == 413 and exc.value.code == "too_many_images" and exc.value.param == "messages"
    assert "images.max_images_per_request" in exc.value.message
    big = json.dumps({"messages": [{"role": "user", "content": [part(caps.max_data_uri_chars + 4)]}]}).encode()
    with pytest.raises(OpenAIError) as exc:
        scan_data_uris(big, caps)
    assert exc.value.status == 413 and exc.value.code == "image_too_large"
    assert "images.max_image_bytes" in exc.value.message


def test_escaped_strings_are_never_exempt_from_the_text_cap():
    # A "data:" string with escapes could hide JSON structure; it counts as text.
    sneaky = b'{"x": {"url": "data:' + b'\\"' * 40_000 + b'"}}'
    with pytest.raises(OpenAIError) as exc:
        scan_data_uris(sneaky, _caps())
    assert exc.value.status == 413


def test_budget_refuses_large_bodies_past_it_and_always_admits_small_ones():
    budget = ByteBudget(limit_bytes=10 * MiB, small_bytes=64 * 1024)
    first = budget.lease()
    first.hold(8 * MiB, 4 * MiB)  # a 4 MiB body being parsed
    second = budget.lease()
    with pytest.raises(OpenAIError) as exc:
        second.hold(4 * MiB, 2 * MiB)
    assert exc.value.status == 503 and exc.value.retry_after_s and exc.value.code == "server_busy"
    with pytest.raises(OpenAIError) as exc:
        second.admit(2 * MiB)  # the same answer from its declared length, holding nothing
    assert exc.value.status == 503 and second.held == 0
    small = budget.lease()
    small.hold(64 * 1024, 32 * 1024)  # passes although the budget is full
    first.release()
    second.admit(2 * MiB)
    second.hold(4 * MiB, 2 * MiB)
    small.release(), second.release()
    assert budget.used == 0 and budget.refused == 2


def test_a_body_that_could_never_fit_is_a_413_naming_the_budget_not_a_503():
    budget = ByteBudget(limit_bytes=10 * MiB, small_bytes=64 * 1024)
    for refuse in (lambda lease: lease.admit(6 * MiB), lambda lease: lease.hold(6 * MiB, 6 * MiB)):
        lease = budget.lease()
        with pytest.raises(OpenAIError) as exc:
            refuse(lease)  # parsing 6 MiB takes 12 MiB: no amount of waiting helps
        assert exc.value.status == 413 and exc.value.retry_after_s is None
        assert "limits.ingress_body_budget_bytes" in exc.value.message
    assert budget.used == 0 and budget.refused == 0


def test_the_default_budget_parses_the_largest_body_the_default_caps_allow():
    caps = BodyCaps.from_settings(serving_settings(AppConfig()), images_allowed=True)
    budget = ByteBudget(default_body_budget(caps), serving_settings(AppConfig()).limits.small_request_bytes)
    largest = caps.cap(images=True)
    assert largest > 8 * base64_chars(20 * MiB)  # the promise of docs/configuration.md (limits.max_request_bytes): 8 images of 20 MiB
    lease = budget.lease()
    lease.admit(largest)
    lease.hold(PARSE_CHARGE_PER_BYTE * largest, largest)
    assert budget.used == budget.limit


def test_a_slow_body_holds_only_what_it_has_sent():
    budget = ByteBudget(limit_bytes=10 * MiB, small_bytes=1024)
    caps = BodyCaps.from_settings(_config(max_request_bytes=8 * MiB), True)
    sent = asyncio.Event()
    seen = []

    async def trickle():
        yield b"x" * 100_000
        sent.set()
        await asyncio.sleep(3600)
        yield b"never"

    async def scenario():
        lease = budget.lease()
        reader = asyncio.create_task(read_body(trickle(), str(4 * MiB), caps, True, lease, timeout_s=0.3))
        await sent.wait()
        await asyncio.sleep(0)
        seen.append(budget.used)
        with pytest.raises(OpenAIError) as exc:
            await reader
        lease.release()
        return exc.value

    error = asyncio.run(scenario())
    assert seen == [100_000]  # not the 4 MiB it declared
    assert error.status == 408 and error.code == "request_timeout" and "limits.body_read_timeout_s" in error.message
    assert budget.used == 0


def test_a_read_body_holds_what_parsing_it_takes():
    budget = ByteBudget(limit_bytes=100 * MiB, small_bytes=1024)
    caps = BodyCaps.from_settings(_config(max_request_bytes=MiB), True)
    body, lease = _read(b"y" * 300_000, caps, images_route=False, budget=budget)
    assert lease.held == PARSE_CHARGE_PER_BYTE * len(body) == budget.used


def test_releasing_a_large_body_asks_for_a_heap_trim_and_small_ones_do_not():
    asked = []
    budget = ByteBudget(limit_bytes=10 * MiB, small_bytes=64 * 1024, after_large=lambda: asked.append(1))
    small = budget.lease()
    small.hold(64 * 1024, 32 * 1024)
    small.release()
    assert asked == []
    large = budget.lease()
    large.hold(2 * MiB, 1 * MiB)
    large.hold(0, 1 * MiB)  # parsed: nothing held, still a large body for the trim
    large.release()
    large.release()  # idempotent
    assert asked == [1] and budget.used == 0


def test_heap_trims_are_coalesced_and_the_last_request_is_always_followed_by_one():
    calls = []

    async def scenario() -> None:
        trimmer = HeapTrimmer(delay_s=0.05, trim=lambda: calls.append(1))
        for _ in range(5):
            trimmer.request()
        await asyncio.sleep(0.1)
        assert calls == [1]
        trimmer.request()
        await asyncio.sleep(0.1)
        assert calls == [1, 1] and trimmer.trims == 2

    asyncio.run(scenario())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_the_default_trim_gives_freed_heap_memory_back_to_the_os():
    calls = []

    async def scenario() -> None:
        trimmer = HeapTrimmer(delay_s=0)
        assert trimmer._trim is not None, "glibc's malloc_trim not found"
        real_trim = trimmer._trim
        trimmer._trim = lambda: calls.append(real_trim())
        # What a large parsed body leaves behind: many small-to-medium heap blocks, freed.
        body = b"[" + b",".join([b'{"role": "user", "content": "%s"}' % (b"x" * 600)] * 60_000) + b"]"
        parsed = json.loads(body)
        del body, parsed
        before = _rss_bytes()
        trimmer.request()
        await asyncio.sleep(0.05)
        freed = before - _rss_bytes()
        assert calls and freed > 16 * MiB, f"malloc_trim gave back {freed / MiB:.1f} MiB"

    asyncio.run(scenario())


def test_declared_length_is_admitted_by_the_budget_before_the_body_is_read():
    budget = ByteBudget(limit_bytes=2 * MiB, small_bytes=1024)
    other = budget.lease()
    other.hold(MiB, MiB)
    caps = BodyCaps.from_settings(_config(max_request_bytes=4 * MiB), True)
    read = []

    async def chunks():
        read.append(1)
        yield b"x"

    with pytest.raises(OpenAIError) as exc:
        asyncio.run(read_body(chunks(), str(700_000), caps, True, budget.lease()))
    assert exc.value.status == 503 and budget.used == MiB and read == []


def _checker(**kw) -> ShapeChecker:
    limits = dict(max_messages=4, max_content_parts=3, max_stop_strings=2, max_stop_string_chars=5, max_tools=1)
    limits.update(kw)
    return ShapeChecker(CountLimits(**limits))


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": [{"role": "user", "content": "a"}] * 5}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 4}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": "a"}], "stop": ["a", "b", "c"]}, "stop"),
        ({"messages": [{"role": "user", "content": "a"}], "stop": ["abcdef"]}, "stop"),
        ({"messages": [{"role": "user", "content": "a"}], "tools": [{}, {}]}, "tools"),
    ],
)
def test_counts_are_refused_while_decoding(body, param):
    with pytest.raises(OpenAIError) as exc:
        _checker().check(json.dumps(body).encode(), chat=True)
    assert exc.value.status == 400 and exc.value.param == param, exc.value.message


def test_shape_check_leaves_type_errors_to_pydantic_and_refuses_malformed_json():
    _checker().check(b'{"messages": 5, "stop": 7}', chat=True)  # no count exceeded: pydantic's turn
    _checker().check(b'{"prompt": "x", "stop": "abcdefgh"}', chat=False)  # a single stop string: checked later
    with pytest.raises(OpenAIError) as exc:
        _checker().check(b'{"messages": [', chat=True)
    assert exc.value.status == 400 and "Invalid JSON" in exc.value.message


def test_a_million_messages_are_refused_cheaply():
    import time

    body = json.dumps({"messages": [{"role": "user", "content": "a"}] * 1_000_000}).encode()
    started = time.process_time()
    with pytest.raises(OpenAIError) as exc:
        _checker(max_messages=1024).check(body, chat=True)
    # Not a timing claim (see bench/): only that no pydantic model was built for them.
    assert exc.value.param == "messages", time.process_time() - started


def test_deep_nesting_is_a_400_not_a_crash():
    with pytest.raises(OpenAIError) as exc:
        _checker().check(b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}", chat=True)
    assert exc.value.status == 400


_AFTER_A_LARGE_BODY = """
import os, sys
from mmserve.openai.body_memory import map_large_blocks_separately
MiB = 1 << 20
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
if sys.argv[1] == "mapped":
    assert map_large_blocks_separately(), "glibc's mallopt not found"
first = bytes(bytearray(30 * MiB))  # one large body, freed: glibc's threshold grows past it
del first
before = rss()
blocks = [bytes(bytearray(MiB)) for _ in range(40)]  # then 40 MiB in 1 MiB blocks, freed
grown = rss() - before
del blocks
print(grown // MiB, (before + grown - rss()) // MiB)
"""


def _after_a_large_body(mode: str) -> tuple[int, int]:
    """MiB grown and given back by blocks freed after a large body, in a fresh process (a heap
    with free chunks would serve them whatever the threshold)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _AFTER_A_LARGE_BODY, mode], capture_output=True, text=True, check=True)
    grown, freed = map(int, out.stdout.split())
    return grown, freed


def test_large_blocks_get_their_own_mapping_and_go_back_to_the_os_when_freed():
    grown, freed = _after_a_large_body("mapped")
    assert grown >= 30 and freed >= 30, (grown, freed)
    # glibc's default keeps them: what the ingress did before (the check can tell the difference).
    grown, freed = _after_a_large_body("default")
    assert grown >= 30 and freed < 10, (grown, freed)

"""Request intake: what a request body may cost the ingress, refused by the cheapest measure first.

Order, each step cheaper than the one it protects:

1. the declared `Content-Length` against the route's byte cap (413), then against the replica's
   byte budget: 413 if parsing it could never fit, 503 with `Retry-After` if it does not fit now
   (small bodies always pass); nothing is held for bytes not yet sent;
2. the bytes as they stream in, within `limits.body_read_timeout_s` (408): the same cap, the
   budget for what has arrived, and past the text cap an image part must have been seen (a
   text-only body never needs the image allowance);
3. a byte scan for image data URIs (C-speed `find`s): their count, each one's encoded length
   (before any base64 decoding; 413 for either), and the bytes outside them against the text
   cap (413), so that the structure pydantic will build stays small whatever the body's size;
4. a msgspec pass over the body's shape (messages, content parts, stop strings, tools) with the
   configured counts as `max_length` constraints, ≈20× cheaper than the pydantic parse it guards;
5. only then pydantic (`protocol.py`), which gives the field-by-field 400s.

Plain classes, testable without Ray or HTTP; the ingress deployment wires them to Starlette.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import re
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from .errors import OpenAIError, bad_request
from .settings import ServingSettings

# An image part's marker, and a data URI as a JSON string value of "url" (no escapes inside:
# base64 never needs them, and a string with escapes is counted as text, never exempted).
IMAGE_PART_MARKER = b'"image_url"'
_DATA_URL = re.compile(rb'"url"\s*:\s*"data:')
# JSON around one image part ({"type":"image_url","image_url":{"url":"data:image/png;base64,"}}).
_PER_IMAGE_SLACK = 1024


def base64_chars(n_bytes: int) -> int:
    """Characters of the padded base64 encoding of `n_bytes` bytes."""
    return (n_bytes + 2) // 3 * 4


@dataclass(frozen=True)
class BodyCaps:
    """Byte caps per request kind, from the configuration."""

    text_bytes: int  # bodies without images, and every body's bytes outside image data URIs
    max_images: int
    max_data_uri_chars: int  # one image's data URI (base64 of images.max_image_bytes, + header)
    images_allowed: bool  # the model takes images (chat route only)

    @classmethod
    def from_settings(cls, settings: ServingSettings, images_allowed: bool) -> "BodyCaps":
        return cls(
            text_bytes=settings.limits.max_request_bytes,
            max_images=settings.max_images_per_request,
            max_data_uri_chars=base64_chars(settings.max_image_bytes) + 256,
            images_allowed=images_allowed,
        )

    def cap(self, images: bool) -> int:
        """The largest body a route accepts (`images`: the route takes image parts)."""
        if not (images and self.images_allowed):
            return self.text_bytes
        return self.text_bytes + self.max_images * (self.max_data_uri_chars + _PER_IMAGE_SLACK)


def too_large(limit: int, what: str = "request body") -> OpenAIError:
    return OpenAIError(f"{what} exceeds {limit} bytes", status=413, code="request_too_large")


# Bytes a body costs the replica while it is parsed: the body itself and what pydantic makes of
# it (strings of about the same size). Image payloads are charged the same until the preprocessor
# has them: the strings, and their serialised copy for the Ray call.
PARSE_CHARGE_PER_BYTE = 2


def default_body_budget(caps: BodyCaps) -> int:
    """The budget that admits the largest body the caps allow (with images) on an idle replica."""
    largest = BodyCaps(caps.text_bytes, caps.max_images, caps.max_data_uri_chars, images_allowed=True).cap(images=True)
    return PARSE_CHARGE_PER_BYTE * largest


class ByteBudget:
    """Bytes of request bodies (and their parsed forms) held by one ingress replica.

    Bodies up to `small_bytes` always pass: the budget guards against a few large requests
    taking the replica's memory, not against many ordinary ones (Serve's `max_ongoing_requests`
    bounds those). A large body that could never fit is refused with 413 naming the limit; one
    that does not fit now, with 503 and `Retry-After` (waiting helps: other bodies leave).
    Single-threaded (the replica's event loop), so no lock.
    """

    def __init__(self, limit_bytes: int, small_bytes: int, after_large: Callable[[], None] | None = None) -> None:
        self.limit = limit_bytes
        self.small = small_bytes
        self.used = 0
        self.refused = 0
        self.after_large = after_large  # called when a large body's share is given back

    def lease(self) -> "BudgetLease":
        return BudgetLease(self)

    def never_fits(self, body_bytes: int) -> OpenAIError:
        return OpenAIError(
            f"a request body of {body_bytes} bytes can never be admitted: parsing it takes "
            f"{PARSE_CHARGE_PER_BYTE * body_bytes} bytes of the replica's body budget of {self.limit} "
            "(limits.ingress_body_budget_bytes)",
            status=413, code="request_too_large",
        )

    def busy(self) -> OpenAIError:
        self.refused += 1
        return OpenAIError(
            "the server is busy with other large requests; retry shortly",
            status=503, code="server_busy", retry_after_s=1,
        )


class BudgetLease:
    """One request's share of the budget: what it holds now, changed as its bytes come and go.

    While the body is read: the bytes received (a slow body holds what it has sent, not what it
    declared); while it is parsed: twice the body; then twice its image payloads until the
    preprocessor has them (`release()`), nothing for text. Generation holds nothing.
    """

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self.held = 0
        self.large = False  # a body past the budget's small size: refusable, trimmed after

    def admit(self, body_bytes: int) -> None:
        """Refuse a body of `body_bytes` now if it could never fit (413) or does not fit now
        (503); holds nothing."""
        budget = self.budget
        if body_bytes <= budget.small:
            return
        charge = PARSE_CHARGE_PER_BYTE * body_bytes
        if charge > budget.limit:
            raise budget.never_fits(body_bytes)
        if budget.used - self.held + charge > budget.limit:
            raise budget.busy()

    def hold(self, amount: int, body_bytes: int) -> None:
        """Hold `amount` bytes for a body of `body_bytes` (more or fewer than now). Growing past
        the budget refuses a large body (413 if it never could fit, else 503); shrinking never fails."""
        budget = self.budget
        if body_bytes > budget.small:
            self.large = True
            if amount > self.held:
                if PARSE_CHARGE_PER_BYTE * body_bytes > budget.limit:
                    raise budget.never_fits(body_bytes)
                if budget.used - self.held + amount > budget.limit:
                    raise budget.busy()
        budget.used += amount - self.held
        self.held = amount

    def release(self) -> None:
        """Give everything back (idempotent)."""
        budget = self.budget
        budget.used -= self.held
        self.held = 0
        if self.large:
            self.large = False
            if budget.after_large is not None:
                budget.after_large()


def _glibc() -> ctypes.CDLL | None:
    libc_name = ctypes.util.find_library("c")
    return ctypes.CDLL(libc_name) if libc_name else None


def _glibc_malloc_trim() -> Callable[[], object] | None:
    trim = getattr(_glibc(), "malloc_trim", None)  # glibc only (not musl, not macOS)
    return None if trim is None else (lambda: trim(0))


# glibc's mallopt parameter for the size from which blocks get their own mapping.
_M_MMAP_THRESHOLD = -3


def map_large_blocks_separately(threshold_bytes: int = 128 * 1024) -> bool:
    """Blocks from `threshold_bytes` up get their own mapping, given back to the OS when freed.

    glibc's default threshold grows to the size of the largest block freed (up to 32 MiB), so
    after one large body the next ones are carved from the heap, where freed memory stays: an
    ingress replica kept +82 MB a minute after an abuse run (bench/abuse_bench.py), +5 MB with a
    fixed threshold. Setting it also turns glibc's growth off. False where this is not glibc.
    """
    mallopt = getattr(_glibc(), "mallopt", None)
    return bool(mallopt is not None and mallopt(_M_MMAP_THRESHOLD, threshold_bytes))


class HeapTrimmer:
    """Gives the heap memory a large body leaves behind back to the OS, shortly after it is freed.

    glibc keeps freed memory in its arenas, and a freed 30 MB body raises its mmap threshold so that
    the next ones are carved from the heap too: without this, an ingress replica kept +350 MB after
    an abuse run (bench/abuse_bench.py). `malloc_trim(0)` costs ≈15 ms per 350 MB freed; requests
    coalesce into at most one call per `delay_s`, on the event loop (the last request is always
    followed by a call).
    """

    def __init__(self, delay_s: float = 0.5, trim: Callable[[], object] | None = None) -> None:
        self.delay_s = delay_s
        self._trim = trim if trim is not None else _glibc_malloc_trim()
        self._pending: asyncio.TimerHandle | None = None
        self.trims = 0

    def request(self) -> None:
        if self._trim is None or self._pending is not None:
            return
        self._pending = asyncio.get_running_loop().call_later(self.delay_s, self._run)

    def _run(self) -> None:
        self._pending = None
        self.trims += 1
        self._trim()


async def read_body(
    chunks: AsyncIterable[bytes], declared: str | None, caps: BodyCaps, images_route: bool, lease: BudgetLease,
    timeout_s: float | None = None,
) -> bytearray:
    """The request body, refused as early as its size allows (see the module docstring), and
    with 408 if it takes longer than `timeout_s` to arrive. On return the lease holds what
    parsing the body will take."""
    cap = caps.cap(images_route)
    if declared is not None and declared.strip().isdigit():
        length = int(declared)
        if length > cap:
            raise too_large(cap)
        lease.admit(length)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            await _read_into(body, chunks, caps, cap, lease)
    except TimeoutError:
        raise OpenAIError(
            f"the request body did not arrive within {timeout_s:g} s (limits.body_read_timeout_s); "
            f"{len(body)} bytes were received",
            status=408, code="request_timeout",
        ) from None
    lease.hold(PARSE_CHARGE_PER_BYTE * len(body), len(body))
    return body


async def _read_into(body: bytearray, chunks: AsyncIterable[bytes], caps: BodyCaps, cap: int, lease: BudgetLease) -> None:
    image_seen = False
    async for chunk in chunks:
        if not chunk:
            continue
        before = len(body)
        body += chunk
        if len(body) > cap:
            raise too_large(cap)
        if len(body) > caps.text_bytes and not image_seen:
            # Search the new bytes (and a marker's length back, for a marker split over chunks).
            image_seen = body.find(IMAGE_PART_MARKER, max(0, before - len(IMAGE_PART_MARKER))) != -1 or (
                before <= caps.text_bytes and body.find(IMAGE_PART_MARKER, 0, before) != -1
            )
            if not image_seen:
                raise too_large(caps.text_bytes, "a request body without images")
        lease.hold(len(body), len(body))


@dataclass(frozen=True)
class DataUriSpan:
    start: int  # offset of the first character after "data:"
    end: int  # offset of the closing quote


def scan_data_uris(body: bytes | bytearray, caps: BodyCaps) -> list[DataUriSpan]:
    """Image data URIs in the body, found by byte search; refuses too many, too long ones, and
    bodies whose other bytes exceed the text cap. Linear in the body, no Python objects per byte."""
    spans: list[DataUriSpan] = []
    exempt = 0
    for match in _DATA_URL.finditer(body):
        start = match.end()
        end = body.find(b'"', start)
        if end == -1:
            break  # unterminated: the JSON parser will say so
        if body.find(b"\\", start, end) != -1:
            continue  # escapes inside: not a plain base64 URI, counted as text
        spans.append(DataUriSpan(start, end))
        if len(spans) > caps.max_images:
            raise OpenAIError(
                f"more than {caps.max_images} images in one request; at most {caps.max_images} are allowed "
                "(images.max_images_per_request)",
                status=413, param="messages", code="too_many_images",
            )
        if end - start > caps.max_data_uri_chars:
            raise OpenAIError(
                f"image {len(spans)}: its data URI has {end - start} characters; images are limited to "
                f"{caps.max_data_uri_chars} (images.max_image_bytes, base64-encoded)",
                status=413, param="messages", code="image_too_large",
            )
        exempt += end - start
    if len(body) - exempt > caps.text_bytes:
        raise too_large(caps.text_bytes, "the request body outside its images")
    return spans


# ----------------------------------------------------------------------------- shape check


@dataclass(frozen=True)
class CountLimits:
    max_messages: int
    max_content_parts: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_tools: int

    @classmethod
    def from_settings(cls, settings: ServingSettings) -> "CountLimits":
        limits = settings.limits
        return cls(
            max_messages=limits.max_messages,
            max_content_parts=limits.max_content_parts,
            max_stop_strings=limits.max_stop_strings,
            max_stop_string_chars=limits.max_stop_string_chars,
            max_tools=limits.max_tools,
        )


class ShapeChecker:
    """The counted parts of a request body, decoded by msgspec with the limits as `max_length`.

    Only counts are judged here: a type mismatch is left to pydantic, whose 400 names the field
    the way every other validation error does. Malformed JSON is refused here (cheaper).
    """

    def __init__(self, limits: CountLimits) -> None:
        stop = (
            str
            | Annotated[list[Annotated[str, Meta(max_length=limits.max_stop_string_chars)]], Meta(max_length=limits.max_stop_strings)]
            | None
        )
        message = msgspec.defstruct(
            "MessageShape",
            [("content", str | Annotated[list[msgspec.Raw], Meta(max_length=limits.max_content_parts)] | None, None)],
        )
        sampling = [("stop", stop, None)]
        self._chat = msgspec.json.Decoder(msgspec.defstruct("ChatShape", [
            ("messages", Annotated[list[message], Meta(max_length=limits.max_messages)] | None, None),
            ("tools", Annotated[list[msgspec.Raw], Meta(max_length=limits.max_tools)] | None, None),
            *sampling,
        ]))
        self._completion = msgspec.json.Decoder(msgspec.defstruct("CompletionShape", sampling))
        self.limits = limits

    def check(self, body: bytes | bytearray, chat: bool) -> None:
        decoder = self._chat if chat else self._completion
        try:
            decoder.decode(body)
        except msgspec.ValidationError as exc:  # (a DecodeError subclass: caught first)
            message = str(exc)
            if "length <=" not in message:
                return  # a type error: pydantic reports it in its own words
            param = _param_of(message)
            if param is not None and param.startswith("stop."):
                param = "stop"  # as request_checks.py names it for every stop-string rule
            raise bad_request(_count_message(message, self.limits), param) from None
        except msgspec.DecodeError as exc:
            raise bad_request(f"Invalid JSON body: {exc}") from None
        except RecursionError:
            raise bad_request("Invalid JSON body: nested too deeply") from None


def _param_of(message: str) -> str | None:
    # msgspec: "Expected `array` of length <= 1024 - at `$.messages`"
    at = message.rpartition(" - at `$.")[2].rstrip("`")
    return re.sub(r"\[(\d+)\]", r".\1", at) if at != message else None


def _count_message(message: str, limits: CountLimits) -> str:
    param = _param_of(message) or ""
    if param == "messages":
        return f"at most {limits.max_messages} messages are allowed (limits.max_messages)"
    if param.endswith(".content"):
        return f"{param}: at most {limits.max_content_parts} content parts per message (limits.max_content_parts)"
    if param == "tools":
        return f"at most {limits.max_tools} tools are allowed (limits.max_tools)"
    if param == "stop":
        return f"at most {limits.max_stop_strings} stop strings are allowed"
    if param.startswith("stop"):
        return f"stop strings are limited to {limits.max_stop_string_chars} characters"
    return message


def text_chars(value: Any) -> int:
    """Characters of text in a message's content (image parts count nothing)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(len(part.text) for part in value if getattr(part, "type", None) == "text")
    return 0

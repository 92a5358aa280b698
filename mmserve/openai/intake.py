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
   configured counts as `max_length` constraints, far cheaper than the pydantic parse it guards;
5. only then pydantic (`protocol.py`), which gives the field-by-field 400s.

Plain classes, testable without Ray or HTTP; the ingress deployment wires them to Starlette.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from .body_memory import PARSE_CHARGE_PER_BYTE, BudgetLease
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


def default_body_budget(caps: BodyCaps) -> int:
    """The budget that admits the largest body the caps allow (with images) on an idle replica."""
    largest = BodyCaps(caps.text_bytes, caps.max_images, caps.max_data_uri_chars, images_allowed=True).cap(images=True)
    return PARSE_CHARGE_PER_BYTE * largest


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

"""Image bytes from a `data:` URI (size checked before decoding) or a `file://` URL (below the allowed directory only)."""

from __future__ import annotations

import binascii
import os
import re
import stat
from pathlib import Path
from urllib.parse import unquote, urlsplit

from .policy import FetchError, FetchPolicy

_MIME_TYPE = re.compile(r"image/[a-z0-9][a-z0-9.+\-]*")
_NOT_BASE64 = (
    "data: URI payload is not valid base64 (expected the standard alphabet A-Z a-z 0-9 + /, "
    "padded with '=' to a multiple of 4 characters, no whitespace)"
)


def decode_data_uri(url: str, policy: FetchPolicy) -> bytes:
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise FetchError("malformed data: URI (no comma before the payload)")
    params = [p.strip() for p in header.split(";")]
    mime = params[0].lower()
    if not mime:
        raise FetchError("data: URI has no media type; expected data:image/<type>;base64,...")
    if not _MIME_TYPE.fullmatch(mime):
        raise FetchError(f"data: URI media type {params[0][:64]!r} is not an image type")
    if len(params) < 2 or params[-1].lower() != "base64":
        raise FetchError("data: URI is not base64-encoded; only data:image/<type>;base64,... is accepted")

    # The decoded size follows from the encoded length: refuse an oversized image before decoding it.
    n = len(payload)
    if n == 0:
        raise FetchError("data: URI payload is empty")
    padding = 2 if payload.endswith("==") else 1 if payload.endswith("=") else 0
    decoded_size = (n + 3) // 4 * 3 - padding
    if decoded_size > policy.max_image_bytes:
        raise FetchError(f"image exceeds {policy.max_image_bytes} bytes (data: URI decodes to ~{decoded_size})")

    try:
        raw = payload.encode("ascii")
    except UnicodeEncodeError:
        raise FetchError("data: URI payload is not valid base64 (non-ASCII characters)") from None
    # One pass: strict mode refuses what is outside the alphabet, padding anywhere but at the end,
    # and whitespace, as a separate regex match (and b64decode(validate=True)'s own) would: two
    # scans of the payload fewer.
    if n % 4 != 0:
        raise FetchError(_NOT_BASE64)
    try:
        return binascii.a2b_base64(raw, strict_mode=True)
    except (binascii.Error, ValueError):
        raise FetchError(_NOT_BASE64) from None


# --------------------------------------------------------------------------------------------- file:


def read_local_file(url: str, policy: FetchPolicy) -> bytes:
    assert policy.allowed_local_dir is not None
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise FetchError("file:// image URLs must not name a host")
    if parts.query or parts.fragment:
        raise FetchError("file:// image URLs must not have a query or fragment")
    path = unquote(parts.path)
    if "\x00" in path:
        raise FetchError("file:// image path is invalid")
    if not path.startswith("/"):
        raise FetchError("file:// image path must be absolute")
    try:
        root = Path(os.path.realpath(policy.allowed_local_dir))
        resolved = Path(path).resolve(strict=True)
    except FileNotFoundError:
        raise FetchError("image file not found") from None
    except (OSError, RuntimeError):  # RuntimeError: symlink loop (older Pythons)
        raise FetchError("image file cannot be resolved") from None
    if not resolved.is_relative_to(root):
        raise FetchError("image file is outside the allowed directory")
    try:
        fd = os.open(resolved, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        raise FetchError("image file cannot be opened") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FetchError("image path is not a regular file")
        if info.st_size > policy.max_image_bytes:
            raise FetchError(f"image exceeds {policy.max_image_bytes} bytes (file is {info.st_size})")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read(policy.max_image_bytes + 1)  # the file may have grown since fstat
    except OSError:
        raise FetchError("image file cannot be read") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > policy.max_image_bytes:
        raise FetchError(f"image exceeds {policy.max_image_bytes} bytes")
    return data

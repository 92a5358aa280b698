"""A chat request over a bare socket, for tests of clients that leave: it is sent without waiting
for an answer (the gateway answers headers only with its first event), read as far as wanted, and
the connection reset rather than closed."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit


def send_chat(base_url: str, body: dict) -> socket.socket:
    """POST `body` to `base_url`/v1/chat/completions and return without reading anything."""
    url = urlsplit(base_url)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    head = (
        f"POST {url.path}/v1/chat/completions HTTP/1.1\r\nHost: {url.hostname}:{url.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    return sock


def read_until(sock: socket.socket, marker: bytes, timeout_s: float, received: bytes = b"") -> bytes:
    """What the socket has sent (after `received`) once `marker` is in it, or when `timeout_s` has
    passed without it (the caller looks)."""
    deadline = time.monotonic() + timeout_s
    while marker not in received and (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        if not data:
            break
        received += data
    return received


def reset(sock: socket.socket) -> None:
    """Leave: RST rather than FIN, so that the proxy sees the client gone at once."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()

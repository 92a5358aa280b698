"""Network fetching for image URLs: an OpenAI `image_url.url` string -> image bytes, safely, every limit enforced first.

Three kinds of URL are understood:

* ``data:image/<type>;base64,<payload>`` — the decoded size is computed from the payload's length and
  refused before anything is decoded; the base64 must be strict (standard alphabet, padded, no
  whitespace); the media type must be ``image/*``.
* ``http://`` / ``https://`` — the host is resolved first (asynchronously, ``loop.getaddrinfo`` or an
  injected resolver) and refused if ANY of its addresses is loopback, private, link-local, multicast,
  reserved, unspecified, shared (CGNAT) or otherwise non-global — including IPv4 embedded in IPv6
  (``::ffff:10.0.0.1``, NAT64 ``64:ff9b::/96``, 6to4, Teredo) — unless the host or the address is in
  ``FetchPolicy.allowed_hosts`` (or ``allow_private_networks`` is set).

  The connection then goes to the *vetted IP itself*, so a DNS answer that changes between the check
  and the connect (DNS rebinding) cannot send the request anywhere else: the request URL is rewritten
  to ``scheme://<ip>:<port>/path``, the ``Host`` header is set to the original host, and for https the
  httpx/httpcore request extension ``sni_hostname`` makes the TLS handshake send the original host as
  SNI and verify the certificate against the original host name (httpcore passes it as
  ``server_hostname`` to ``start_tls``; with ``check_hostname`` on, that is the name checked). No name
  lookup is left for httpx to do. When no client is given, a fresh ``httpx.AsyncClient`` is made for the
  fetch, with ``trust_env=False`` (an environment proxy would resolve names itself). Every request
  carries ``Connection: close``: httpx pools connections by (scheme, IP, port) and a pooled TLS
  connection keeps the SNI and certificate check of the host it was opened for, so reusing it for
  another name on the same IP would skip that name's certificate check.

  Redirects are followed by hand, at most ``max_redirects``, and each hop's scheme and host are checked
  again (a redirect may only go to http/https). ``Content-Length`` is checked before the body is read;
  the body is streamed raw (``Accept-Encoding: identity``; a compressed response is refused so that a
  gzip bomb cannot inflate past the cap) and abandoned as soon as it passes ``max_image_bytes``. One
  timeout, ``fetch_timeout_s``, covers the whole fetch: resolution, every hop, and the body.
* ``file://`` — only when ``FetchPolicy.allowed_local_dir`` is set (it is off by default, whatever
  ``allowed_url_schemes`` says). The path is resolved with ``Path.resolve(strict=True)`` (all symlinks
  and ``..`` followed) and must land inside the real path of the allowed directory; it must be a
  regular file, and its size is checked with ``fstat`` before it is read.

Every refusal is a `FetchError` (a ``ValueError``) whose message is meant for the
client: it names the problem, never carries a stack trace or an exception repr from inside httpx.
"""

from __future__ import annotations

import asyncio

import httpx

from .http import fetch_http
from .local import decode_data_uri, read_local_file
from .policy import FetchError, FetchPolicy, Resolver, system_resolver

__all__ = ["FetchError", "FetchPolicy", "Resolver", "fetch_image_bytes", "system_resolver"]


async def fetch_image_bytes(
    url: str,
    policy: FetchPolicy,
    *,
    client: httpx.AsyncClient | None = None,
    resolver: Resolver | None = None,
) -> bytes:
    """The bytes behind an image URL (data:, http(s): or — if enabled — file:), or a `FetchError`.

    `client` is used for http(s) if given; it should speak HTTP/1.1 only (no ``http2=True``: an HTTP/2
    connection would be shared across host names that resolve to the same IP) and use no proxy. Redirect
    following is turned off per request whatever the client's setting. Without a client, one is made
    for this fetch (sharing a module-wide TLS context). `resolver` replaces `system_resolver` (tests use
    it to simulate DNS).
    """
    if not isinstance(url, str) or not url:
        raise FetchError("image URL is empty")
    scheme = url.split(":", 1)[0].lower()[:32] if ":" in url else ""
    if scheme == "file":
        if policy.allowed_local_dir is None:
            raise FetchError("file:// image URLs are not allowed")
        return read_local_file(url, policy)
    if scheme not in policy.allowed_url_schemes:
        raise FetchError(f"image URL scheme {scheme + ':' if scheme else '(none)'} is not allowed")
    if scheme == "data":
        return decode_data_uri(url, policy)
    if scheme in ("http", "https"):
        timeout = policy.fetch_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await fetch_http(url, policy, client, resolver or system_resolver)
        except (TimeoutError, httpx.TimeoutException):
            raise FetchError(f"image fetch timed out after {timeout:g} s") from None
    raise FetchError(f"image URL scheme {scheme}: is not supported")

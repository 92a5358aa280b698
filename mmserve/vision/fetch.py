"""An OpenAI `image_url.url` string -> image bytes, safely, every limit enforced before the costly step.

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

Every refusal is a `FetchError` (an `ImageError`, hence a ``ValueError``) whose message is meant for the
client: it names the problem, never carries a stack trace or an exception repr from inside httpx.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import ipaddress
import os
import re
import socket
import ssl
import stat
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import httpx

from mmserve.vision.image_io import ImageError

__all__ = ["FetchError", "FetchPolicy", "Resolver", "fetch_image_bytes", "system_resolver"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# resolver(host, port) -> the addresses the host resolves to, as strings ("93.184.216.34", "2606:2800::1").
Resolver = Callable[[str, int], Awaitable[Iterable[str]]]

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_BASE64_CHARS = re.compile(rb"[A-Za-z0-9+/]*={0,2}")
_MIME_TYPE = re.compile(r"image/[a-z0-9][a-z0-9.+\-]*")


class FetchError(ImageError):
    """The image URL was refused or could not be fetched; the message is safe to show to the client."""


@dataclass(frozen=True)
class FetchPolicy:
    max_image_bytes: int = 20 * 1024 * 1024
    # Covers the whole fetch: name resolution, every redirect hop, and reading the body.
    fetch_timeout_s: float = 10.0
    max_redirects: int = 3
    allowed_url_schemes: tuple[str, ...] = ("http", "https", "data")
    allow_private_networks: bool = False
    # Host names (matched exactly, case-insensitively), IP addresses or CIDR networks (matched against
    # every resolved address) that are exempt from the private-address refusal.
    allowed_hosts: tuple[str, ...] = ()
    # file:// URLs are refused unless this is set; then only files whose real path is under it are read.
    allowed_local_dir: str | None = None
    user_agent: str = "mmserve-image-fetch/0.1"

    _allowed_names: frozenset[str] = field(init=False, repr=False, compare=False)
    _allowed_networks: tuple[IPNetwork, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_image_bytes <= 0:
            raise ValueError(f"max_image_bytes must be positive, got {self.max_image_bytes}")
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be positive, got {self.fetch_timeout_s}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be >= 0, got {self.max_redirects}")
        object.__setattr__(self, "allowed_url_schemes", tuple(s.lower() for s in self.allowed_url_schemes))
        names: set[str] = set()
        networks: list[IPNetwork] = []
        for entry in self.allowed_hosts:
            entry = entry.strip()
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                if not entry:
                    raise ValueError("allowed_hosts contains an empty entry") from None
                names.add(entry.lower().rstrip("."))
        object.__setattr__(self, "_allowed_names", frozenset(names))
        object.__setattr__(self, "_allowed_networks", tuple(networks))

    def host_is_allowlisted(self, host: str) -> bool:
        return host.lower().rstrip(".") in self._allowed_names

    def address_is_allowlisted(self, address: IPAddress) -> bool:
        candidates = [address]
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            candidates.append(address.ipv4_mapped)
        return any(a in net for a in candidates for net in self._allowed_networks if a.version == net.version)


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to, via the event loop's (threaded) getaddrinfo."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


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
        return _read_local_file(url, policy)
    if scheme not in policy.allowed_url_schemes:
        raise FetchError(f"image URL scheme {scheme + ':' if scheme else '(none)'} is not allowed")
    if scheme == "data":
        return _decode_data_uri(url, policy)
    if scheme in ("http", "https"):
        timeout = policy.fetch_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await _fetch_http(url, policy, client, resolver or system_resolver)
        except (TimeoutError, httpx.TimeoutException):
            raise FetchError(f"image fetch timed out after {timeout:g} s") from None
    raise FetchError(f"image URL scheme {scheme}: is not supported")


# ---------------------------------------------------------------------------------------------- data:


def _decode_data_uri(url: str, policy: FetchPolicy) -> bytes:
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
    if n % 4 != 0 or not _BASE64_CHARS.fullmatch(raw):
        raise FetchError(
            "data: URI payload is not valid base64 (expected the standard alphabet A-Z a-z 0-9 + /, "
            "padded with '=' to a multiple of 4 characters, no whitespace)"
        )
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise FetchError("data: URI payload is not valid base64") from None


# --------------------------------------------------------------------------------------------- file:


def _read_local_file(url: str, policy: FetchPolicy) -> bytes:
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


# ----------------------------------------------------------------------------------------- http(s):


def _non_public_reason(address: IPAddress) -> str | None:
    """Why `address` must not be fetched from (None if it is a public unicast address)."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = None
        if address.ipv4_mapped is not None:
            embedded = address.ipv4_mapped
        elif address in _NAT64 or (address in _IPV4_COMPATIBLE and int(address) > 1):
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        elif address.sixtofour is not None:
            embedded = address.sixtofour
        elif address.teredo is not None:
            embedded = address.teredo[1]
        if embedded is not None:
            inner = _non_public_reason(embedded)
            if inner is not None:
                return inner
    if address.is_unspecified:
        return "unspecified"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_multicast:
        return "multicast"
    if address.is_private:
        return "private"
    if address.is_reserved:
        return "reserved"
    if isinstance(address, ipaddress.IPv6Address) and address.is_site_local:
        return "site-local"
    if not address.is_global:
        return "non-public"
    return None


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # deprecated ::a.b.c.d form


@dataclass
class _Target:
    url: httpx.URL  # the URL as given (host name intact): used to resolve relative redirects
    scheme: str
    host: str  # ASCII (IDNA) host name or IP literal, no brackets
    port: int


def _parse_http_url(url: str | httpx.URL, policy: FetchPolicy) -> _Target:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError):
        raise FetchError("image URL is malformed") from None
    scheme = parsed.scheme.lower()
    if scheme not in ("http", "https") or scheme not in policy.allowed_url_schemes:
        raise FetchError(f"image URL scheme {scheme}: is not allowed")
    if parsed.userinfo:
        raise FetchError("image URLs with credentials (user:password@) are not allowed")
    host = parsed.raw_host.decode("ascii").strip("[]").rstrip(".").lower()
    if not host:
        raise FetchError("image URL has no host")
    port = parsed.port or _DEFAULT_PORTS[scheme]
    return _Target(url=parsed, scheme=scheme, host=host, port=port)


async def _vetted_addresses(target: _Target, policy: FetchPolicy, resolver: Resolver) -> list[IPAddress]:
    """The addresses to connect to, all checked; refuses if any of them is not allowed."""
    try:
        literal = ipaddress.ip_address(target.host)
    except ValueError:
        literal = None
    if literal is not None:
        addresses = [literal]
    else:
        try:
            answers = list(await resolver(target.host, target.port))
        except (OSError, UnicodeError):
            raise FetchError(f"cannot resolve image host {target.host}") from None
        addresses = []
        for answer in answers:
            try:
                address = ipaddress.ip_address(str(answer).split("%", 1)[0])  # drop an IPv6 zone id
            except ValueError:
                raise FetchError(f"cannot resolve image host {target.host}") from None
            if address not in addresses:
                addresses.append(address)
        if not addresses:
            raise FetchError(f"cannot resolve image host {target.host}")

    if policy.allow_private_networks or policy.host_is_allowlisted(target.host):
        return addresses
    for address in addresses:
        reason = _non_public_reason(address)
        if reason is not None and not policy.address_is_allowlisted(address):
            raise FetchError(f"image URL resolves to a {reason} address ({_show(address)}), which is not allowed")
    return addresses


def _show(address: IPAddress) -> str:
    """The address as people write it: ::ffff:127.0.0.1 rather than ::ffff:7f00:1."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return f"::ffff:{address.ipv4_mapped}"
    return str(address)


def _pinned_url(target: _Target, address: IPAddress) -> httpx.URL:
    """`target.url` with the host replaced by the vetted IP (port made explicit)."""
    return target.url.copy_with(host=str(address), port=target.port)


def _host_header(target: _Target) -> str:
    host = f"[{target.host}]" if ":" in target.host else target.host
    return host if target.port == _DEFAULT_PORTS[target.scheme] else f"{host}:{target.port}"


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default verifying context (certifi roots), built once: loading the roots takes ~10 ms."""
    return httpx.create_ssl_context()


async def _fetch_http(url: str, policy: FetchPolicy, client: httpx.AsyncClient | None, resolver: Resolver) -> bytes:
    if client is not None:
        return await _follow(url, policy, client, resolver)
    async with httpx.AsyncClient(
        verify=_tls_context(),
        trust_env=False,
        follow_redirects=False,
        timeout=httpx.Timeout(policy.fetch_timeout_s),
        limits=httpx.Limits(max_connections=4, max_keepalive_connections=0),
    ) as own_client:
        return await _follow(url, policy, own_client, resolver)


async def _follow(url: str, policy: FetchPolicy, client: httpx.AsyncClient, resolver: Resolver) -> bytes:
    target = _parse_http_url(url, policy)
    redirects = 0
    while True:
        addresses = await _vetted_addresses(target, policy, resolver)
        outcome = await _request(target, addresses, policy, client)
        if isinstance(outcome, bytes):
            return outcome
        location = outcome
        redirects += 1
        if redirects > policy.max_redirects:
            raise FetchError(f"image URL redirected more than {policy.max_redirects} times")
        try:
            next_url = urljoin(str(target.url), location)
        except ValueError:
            raise FetchError("image URL redirected to a malformed location") from None
        target = _parse_http_url(next_url, policy)


async def _request(
    target: _Target, addresses: list[IPAddress], policy: FetchPolicy, client: httpx.AsyncClient
) -> bytes | str:
    """GET the target from the first vetted address that accepts a connection.

    Returns the body, or the Location of a redirect (a str) for the caller to vet.
    """
    headers = {
        "Host": _host_header(target),
        "User-Agent": policy.user_agent,
        "Accept": "image/*",
        "Accept-Encoding": "identity",
        # No connection reuse: a pooled TLS connection is keyed by (scheme, IP, port) and keeps the SNI
        # and certificate check of the host it was opened for, so reusing it for another host name
        # that resolves to the same IP would skip that host's certificate check.
        "Connection": "close",
    }
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    last_error: Exception | None = None
    for address in addresses:
        request = client.build_request("GET", _pinned_url(target, address), headers=headers, extensions=extensions)
        try:
            response = await client.send(request, stream=True, follow_redirects=False)
        except httpx.TimeoutException:
            raise
        except httpx.InvalidURL:
            # httpx prepares `next_request` for every redirect response even when not following it, and
            # fails on a Location without a host (data:..., mailto:...): never a fetchable http(s) URL.
            raise FetchError(f"image host {target.host} redirected to a URL that is not an allowed http(s) URL") from None
        except httpx.ConnectError as e:
            last_error = e
            continue  # try the next vetted address
        except httpx.HTTPError as e:
            raise FetchError(f"image fetch from {target.host} failed ({_describe(e)})") from e
        try:
            return await _read_response(response, target, policy)
        finally:
            await response.aclose()
    raise FetchError(f"cannot connect to image host {target.host} ({_describe(last_error)})") from last_error


async def _read_response(response: httpx.Response, target: _Target, policy: FetchPolicy) -> bytes | str:
    status = response.status_code
    if status in _REDIRECT_STATUSES:
        location = response.headers.get("location")
        if not location:
            raise FetchError(f"image host {target.host} answered HTTP {status} without a Location")
        return location
    if not 200 <= status < 300:
        raise FetchError(f"image fetch from {target.host} failed: HTTP {status}")
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise FetchError(f"image host {target.host} sent a compressed response ({encoding}), which is not accepted")
    limit = policy.max_image_bytes
    declared = response.headers.get("content-length")
    if declared is not None:
        try:
            declared_size = int(declared)
        except ValueError:
            raise FetchError(f"image host {target.host} sent an invalid Content-Length") from None
        if declared_size > limit:
            raise FetchError(f"image exceeds {limit} bytes (Content-Length is {declared_size})")
    body = bytearray()
    try:
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > limit:
                raise FetchError(f"image exceeds {limit} bytes")
    except httpx.StreamConsumed:
        # A transport that hands back an already-read body (httpx.MockTransport): it is in memory anyway.
        body = bytearray(response.content)
        if len(body) > limit:
            raise FetchError(f"image exceeds {limit} bytes") from None
    except httpx.TimeoutException:
        raise
    except httpx.HTTPError as e:
        raise FetchError(f"image fetch from {target.host} failed while reading the body ({_describe(e)})") from e
    return bytes(body)


def _describe(error: Exception | None) -> str:
    """A short, client-safe description of an httpx error: its kind, not its internals."""
    if error is None:
        return "no address"
    name = type(error).__name__
    if "CERTIFICATE_VERIFY_FAILED" in str(error):
        return "TLS certificate verification failed"
    return {
        "ConnectError": "connection failed",
        "RemoteProtocolError": "the server broke the HTTP protocol",
        "ReadError": "the connection was interrupted",
        "WriteError": "the connection was interrupted",
        "ProxyError": "proxy error",
        "UnsupportedProtocol": "unsupported protocol",
    }.get(name, name)

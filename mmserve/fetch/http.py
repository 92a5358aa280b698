"""Image bytes from an `http(s)://` URL: every resolved address vetted, the connection pinned to the vetted IP, redirects re-checked, the body capped."""

from __future__ import annotations

import functools
import ipaddress
import ssl
from dataclasses import dataclass
from urllib.parse import urljoin

import httpx

from .policy import FetchError, FetchPolicy, IPAddress, Resolver, non_public_reason

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}


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
        reason = non_public_reason(address)
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
    """httpx's default verifying context (certifi roots), built once: loading the roots is not free."""
    return httpx.create_ssl_context()


async def fetch_http(url: str, policy: FetchPolicy, client: httpx.AsyncClient | None, resolver: Resolver) -> bytes:
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

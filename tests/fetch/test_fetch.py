"""Image URL fetching: every refusal rule, each checked so that removing the rule fails a test.

Network discipline: the only servers contacted are the aiohttp servers started here on 127.0.0.1.
Other names and addresses come from stub resolvers, and every case that must be refused is refused
before any connection: those cases use a client whose transport fails the test if it is ever used.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import io
import ipaddress
import os
import ssl
import time
from dataclasses import dataclass, field

import httpx
import pytest
import pytest_asyncio
from aiohttp import web
from PIL import Image

from mmserve.fetch import local as local_module
from mmserve.fetch import policy as policy_module
from mmserve.fetch import FetchError, fetch_image_bytes
from mmserve.vision.image_io import read_header
from tests.support.defaults import fetch_policy, image_limits


def png_bytes(width: int = 5, height: int = 3) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buffer, "PNG")
    return buffer.getvalue()


PNG = png_bytes()
LOCAL = fetch_policy(allowed_hosts=("127.0.0.1",), fetch_timeout_s=5)


# ------------------------------------------------------------------------------------------ helpers


class GuardTransport(httpx.AsyncBaseTransport):
    """A transport that must never be used: any request through it is recorded and fails the test."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        raise AssertionError(f"a connection was attempted to {request.url} ({request.headers.get('host')})")


@pytest_asyncio.fixture
async def guard():
    transport = GuardTransport()
    async with httpx.AsyncClient(transport=transport) as client:
        yield client
    assert transport.requests == []


def stub_resolver(table: dict[str, list[str]], calls: list[str] | None = None):
    """Resolves only the names in `table`; anything else is an OSError, like a failed lookup."""

    async def resolve(host: str, port: int) -> list[str]:
        if calls is not None:
            calls.append(host)
        if host not in table:
            raise OSError(f"stub resolver: unknown host {host}")
        return list(table[host])

    return resolve


@dataclass
class LocalServer:
    port: int
    hits: dict[str, int] = field(default_factory=dict)
    host_headers: list[str] = field(default_factory=list)
    user_agents: list[str] = field(default_factory=list)

    def url(self, path: str, host: str = "127.0.0.1", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}{path}"


def make_app(server_ref: list[LocalServer], stop: asyncio.Event) -> web.Application:
    def record(request: web.Request) -> None:
        server = server_ref[0]
        server.hits[request.path] = server.hits.get(request.path, 0) + 1
        server.host_headers.append(request.headers.get("Host", ""))
        server.user_agents.append(request.headers.get("User-Agent", ""))

    async def img(request):
        record(request)
        return web.Response(body=PNG, content_type="image/png")

    async def redirect_chain(request):
        record(request)
        n = int(request.match_info["n"])
        raise web.HTTPFound("/img" if n == 0 else f"/redirect/{n - 1}")

    async def redirect_to(request):
        record(request)
        raise web.HTTPFound(request.query["loc"])

    async def not_found(request):
        record(request)
        return web.Response(status=404, text="nope")

    async def big_declared(request):
        # Declares 50 MB but sends a few bytes and then stalls: reading the body would hang until the
        # timeout, so only a Content-Length check gives a quick "exceeds".
        record(request)
        response = web.StreamResponse(headers={"Content-Type": "image/png", "Content-Length": str(50_000_000)})
        await response.prepare(request)
        await response.write(b"\x89PNG")
        await _wait(stop, 30)
        return response

    async def big_stream(request):
        # Chunked, no Content-Length, never ends on its own.
        record(request)
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        chunk = b"\0" * 65536
        try:
            while not stop.is_set():
                await response.write(chunk)
                await asyncio.sleep(0.01)
        except (ConnectionError, RuntimeError):
            pass
        return response

    async def slow(request):
        record(request)
        await _wait(stop, 30)
        return web.Response(body=PNG, content_type="image/png")

    async def drip(request):
        # Headers at once, then one byte every 50 ms: no single read ever waits long, only a timeout
        # over the whole fetch stops it.
        record(request)
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            while not stop.is_set():
                await response.write(b"x")
                await asyncio.sleep(0.05)
        except (ConnectionError, RuntimeError):
            pass
        return response

    async def gzipped(request):
        record(request)
        return web.Response(body=b"\x1f\x8b" + b"\0" * 20, headers={"Content-Encoding": "gzip"})

    app = web.Application()
    app.router.add_get("/img", img)
    app.router.add_get("/redirect/{n}", redirect_chain)
    app.router.add_get("/to", redirect_to)
    app.router.add_get("/404", not_found)
    app.router.add_get("/big-declared", big_declared)
    app.router.add_get("/big-stream", big_stream)
    app.router.add_get("/slow", slow)
    app.router.add_get("/drip", drip)
    app.router.add_get("/gzip", gzipped)
    return app


async def _wait(event: asyncio.Event, timeout: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        pass


async def start_server(ssl_context: ssl.SSLContext | None = None):
    stop = asyncio.Event()
    ref: list[LocalServer] = []
    runner = web.AppRunner(make_app(ref, stop), shutdown_timeout=1, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    ref.append(LocalServer(port=port))
    return ref[0], stop, runner


@pytest_asyncio.fixture
async def server():
    srv, stop, runner = await start_server()
    yield srv
    stop.set()
    await runner.cleanup()


# ------------------------------------------------------------------------------------------- policy


def test_policy_defaults():
    policy = fetch_policy()
    assert policy.max_image_bytes == 20 * 1024 * 1024
    assert policy.fetch_timeout_s == 10
    assert policy.max_redirects == 3
    assert policy.allowed_url_schemes == ("http", "https", "data")
    assert policy.allow_private_networks is False
    assert policy.allowed_hosts == ()
    assert policy.allowed_local_dir is None
    assert policy.user_agent
    assert issubclass(FetchError, ValueError)


def test_policy_rejects_nonsense():
    with pytest.raises(ValueError):
        fetch_policy(max_image_bytes=0)
    with pytest.raises(ValueError):
        fetch_policy(fetch_timeout_s=0)
    with pytest.raises(ValueError):
        fetch_policy(max_redirects=-1)


async def test_scheme_not_allowed(guard):
    for url in ("ftp://example.com/a.png", "gopher://x/", "javascript:alert(1)", "/relative.png", "img.png"):
        with pytest.raises(FetchError, match="scheme"):
            await fetch_image_bytes(url, fetch_policy(), client=guard, resolver=stub_resolver({}))
    only_data = fetch_policy(allowed_url_schemes=("data",))
    with pytest.raises(FetchError, match=r"scheme http: is not allowed"):
        await fetch_image_bytes("http://127.0.0.1/x.png", only_data, client=guard)
    with pytest.raises(FetchError, match=r"scheme data: is not allowed"):
        await fetch_image_bytes(
            "data:image/png;base64," + base64.b64encode(PNG).decode(), fetch_policy(allowed_url_schemes=("https",))
        )


# -------------------------------------------------------------------------------------------- data:


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


async def test_data_uri_ok():
    assert await fetch_image_bytes(data_uri(PNG), fetch_policy()) == PNG
    assert await fetch_image_bytes(data_uri(PNG, "IMAGE/PNG"), fetch_policy()) == PNG
    assert await fetch_image_bytes(data_uri(PNG, "image/png;charset=x"), fetch_policy()) == PNG
    assert read_header(await fetch_image_bytes(data_uri(PNG), fetch_policy()), image_limits()).width == 5


@pytest.mark.parametrize(
    "payload",
    [
        "@@@@",  # not in the alphabet
        "iVBORw0KGgo=AAA",  # padding in the middle
        "iVBORw0KGgo=AAAA",  # padding in the middle, length a multiple of 4
        "====",  # padding only
        "iVBORw0KGgo==",  # too much padding
        "iVBO Rw0K",  # whitespace
        "iVBORw0KGg",  # not padded to a multiple of 4
        "iVBORw0KGgo-_A==",  # url-safe alphabet
        "iVBORw0KGgoé===",  # non-ASCII
    ],
)
async def test_data_uri_bad_base64(payload):
    with pytest.raises(FetchError, match="not valid base64"):
        await fetch_image_bytes(f"data:image/png;base64,{payload}", fetch_policy())


async def test_data_uri_too_big_refused_from_length_before_decoding(monkeypatch):
    def no_decode(*args, **kwargs):
        raise AssertionError("base64 was decoded although the length already shows the image is too big")

    monkeypatch.setattr(local_module.binascii, "a2b_base64", no_decode)
    policy = fetch_policy(max_image_bytes=1000)
    # Garbage payload: if the size were not checked first, the error would be about base64.
    with pytest.raises(FetchError, match="image exceeds 1000 bytes"):
        await fetch_image_bytes("data:image/png;base64," + "!" * 1400, policy)
    with pytest.raises(FetchError, match="image exceeds 1000 bytes"):
        await fetch_image_bytes(data_uri(b"\0" * 1001), policy)


async def test_data_uri_size_boundary():
    policy = fetch_policy(max_image_bytes=1000)
    for size in (998, 999, 1000):  # every padding length
        assert await fetch_image_bytes(data_uri(b"\1" * size), policy) == b"\1" * size
    with pytest.raises(FetchError, match="exceeds"):
        await fetch_image_bytes(data_uri(b"\1" * 1001), policy)


@pytest.mark.parametrize("mime", ["text/plain", "application/octet-stream", "text/html", "imagex/png", "image/"])
async def test_data_uri_wrong_mime(mime):
    with pytest.raises(FetchError, match="not an image type"):
        await fetch_image_bytes(data_uri(PNG, mime), fetch_policy())


async def test_data_uri_not_base64_or_malformed():
    with pytest.raises(FetchError, match="not base64-encoded"):
        await fetch_image_bytes("data:image/png,%89PNG%0D%0A", fetch_policy())
    with pytest.raises(FetchError, match="no media type"):
        await fetch_image_bytes("data:;base64," + base64.b64encode(PNG).decode(), fetch_policy())
    with pytest.raises(FetchError, match="no comma"):
        await fetch_image_bytes("data:image/png;base64", fetch_policy())
    with pytest.raises(FetchError, match="empty"):
        await fetch_image_bytes("data:image/png;base64,", fetch_policy())


# ---------------------------------------------------------------------------------------- http: ok


async def test_http_local_allowlisted_ok(server):
    policy = fetch_policy(allowed_hosts=("127.0.0.1",), user_agent="mmserve-test/1")
    assert await fetch_image_bytes(server.url("/img"), policy) == PNG
    assert server.hits["/img"] == 1
    assert server.user_agents == ["mmserve-test/1"]
    assert server.host_headers == [f"127.0.0.1:{server.port}"]


async def test_http_allowlisted_by_cidr_and_by_private_flag(server):
    assert await fetch_image_bytes(server.url("/img"), fetch_policy(allowed_hosts=("127.0.0.0/8",))) == PNG
    assert await fetch_image_bytes(server.url("/img"), fetch_policy(allow_private_networks=True)) == PNG


async def test_http_connects_to_the_vetted_ip_with_the_original_host_header(server):
    # "img.test" exists only in the stub resolver: httpx never resolves it itself, it connects to the
    # address vetted here, and the Host header still names the original host.
    calls: list[str] = []
    resolver = stub_resolver({"img.test": ["127.0.0.1"]}, calls)
    got = await fetch_image_bytes(server.url("/img", host="img.test"), LOCAL, resolver=resolver)
    assert got == PNG
    assert calls == ["img.test"]
    assert server.host_headers == [f"img.test:{server.port}"]


async def test_http_allowlisted_by_host_name(server):
    resolver = stub_resolver({"img.test": ["127.0.0.1"]})
    policy = fetch_policy(allowed_hosts=("IMG.test",))
    assert await fetch_image_bytes(server.url("/img", host="img.test"), policy, resolver=resolver) == PNG
    with pytest.raises(FetchError, match=r"loopback address \(127\.0\.0\.1\)"):
        await fetch_image_bytes(server.url("/img", host="img.test"), fetch_policy(), resolver=resolver)


async def test_http_falls_back_to_the_next_vetted_address(server):
    # The first address refuses connections (nothing listens on 127.0.0.3:port), the second works.
    resolver = stub_resolver({"img.test": ["127.0.0.3", "127.0.0.1"]})
    policy = fetch_policy(allowed_hosts=("127.0.0.0/8",))
    assert await fetch_image_bytes(server.url("/img", host="img.test"), policy, resolver=resolver) == PNG


# ------------------------------------------------------------------------------ http: address refusal


async def test_http_loopback_without_allowlist_refused_before_connecting(server, guard):
    with pytest.raises(FetchError, match=r"resolves to a loopback address \(127\.0\.0\.1\), which is not allowed"):
        await fetch_image_bytes(server.url("/img"), fetch_policy(), client=guard)
    # Also with the function's own client: the server never sees a request.
    with pytest.raises(FetchError, match="loopback"):
        await fetch_image_bytes(server.url("/img"), fetch_policy())
    with pytest.raises(FetchError, match="loopback"):
        await fetch_image_bytes(server.url("/img", host="[::1]"), fetch_policy())
    assert server.hits == {}


@pytest.mark.parametrize(
    "addresses, reason",
    [
        (["10.1.2.3"], r"private address \(10\.1\.2\.3\)"),
        (["192.168.0.7"], r"private address \(192\.168\.0\.7\)"),
        (["172.16.5.5"], r"private address"),
        (["169.254.169.254"], r"link-local address \(169\.254\.169\.254\)"),
        (["::1"], r"loopback address \(::1\)"),
        (["::ffff:127.0.0.1"], r"loopback address \(::ffff:127\.0\.0\.1\)"),
        (["::ffff:10.0.0.1"], r"private address"),
        (["64:ff9b::a00:1"], r"private address"),  # NAT64 of 10.0.0.1
        (["2002:a00:1::1"], r"private address"),  # 6to4 of 10.0.0.1
        (["fe80::1"], r"link-local address"),
        (["fd00::1"], r"private address"),
        (["0.0.0.0"], r"unspecified address"),
        (["::"], r"unspecified address"),
        (["224.0.0.1"], r"multicast address"),
        (["ff02::1"], r"multicast address"),
        (["240.0.0.1"], r"reserved address|private address"),
        (["100.64.0.1"], r"non-public address"),  # shared address space (CGNAT)
        (["93.184.216.34", "10.0.0.5"], r"private address \(10\.0\.0\.5\)"),  # ANY bad address refuses
    ],
)
async def test_http_stub_name_resolving_to_non_public_address_refused(addresses, reason, guard):
    resolver = stub_resolver({"evil.example": addresses})
    for url in ("http://evil.example/cat.png", "https://evil.example/cat.png"):
        with pytest.raises(FetchError, match=reason):
            await fetch_image_bytes(url, fetch_policy(), client=guard, resolver=resolver)


@pytest.mark.parametrize(
    "url, reason",
    [
        ("http://10.0.0.5/x.png", r"private address \(10\.0\.0\.5\)"),
        ("http://[::ffff:169.254.169.254]/latest/meta-data", r"link-local"),
        ("http://0.0.0.0:8080/", r"unspecified"),
        ("http://[fe80::1%25eth0]/", r"link-local|malformed"),
    ],
)
async def test_http_ip_literals_refused_without_resolving(url, reason, guard):
    calls: list[str] = []
    with pytest.raises(FetchError, match=reason):
        await fetch_image_bytes(url, fetch_policy(), client=guard, resolver=stub_resolver({}, calls))
    assert calls == []


async def test_http_public_address_goes_through_the_pinned_ip():
    # A public address passes the check; the request goes to that IP with Host/SNI for the name
    # (a mock transport records it: no real connection anywhere).
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=PNG)

    resolver = stub_resolver({"cdn.example": ["93.184.216.34"]})
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        got = await fetch_image_bytes("https://cdn.example/a/b.png?x=1", fetch_policy(), client=client, resolver=resolver)
    assert got == PNG
    (request,) = seen
    assert str(request.url) == "https://93.184.216.34/a/b.png?x=1"
    assert request.headers["host"] == "cdn.example"
    assert request.extensions["sni_hostname"] == "cdn.example"


async def test_http_unresolvable_host(guard):
    with pytest.raises(FetchError, match="cannot resolve image host nowhere.example"):
        await fetch_image_bytes("http://nowhere.example/x.png", fetch_policy(), client=guard, resolver=stub_resolver({}))
    with pytest.raises(FetchError, match="cannot resolve"):
        await fetch_image_bytes(
            "http://empty.example/x.png", fetch_policy(), client=guard, resolver=stub_resolver({"empty.example": []})
        )


async def test_http_credentials_in_url_refused(guard):
    with pytest.raises(FetchError, match="credentials"):
        await fetch_image_bytes("http://user:pw@127.0.0.1/x.png", LOCAL, client=guard)


# ---------------------------------------------------------------------------------- http: redirects


async def test_redirects_followed_up_to_the_limit(server):
    policy = fetch_policy(allowed_hosts=("127.0.0.1",), max_redirects=3)
    assert await fetch_image_bytes(server.url("/redirect/2"), policy) == PNG  # 3 redirects
    assert server.hits["/img"] == 1


async def test_too_many_redirects(server):
    policy = fetch_policy(allowed_hosts=("127.0.0.1",), max_redirects=3)
    with pytest.raises(FetchError, match="redirected more than 3 times"):
        await fetch_image_bytes(server.url("/redirect/3"), policy)  # 4 redirects
    assert "/img" not in server.hits
    with pytest.raises(FetchError, match="redirected more than 0 times"):
        await fetch_image_bytes(server.url("/redirect/0"), fetch_policy(allowed_hosts=("127.0.0.1",), max_redirects=0))


async def test_redirect_to_non_allowlisted_address_refused(server):
    # The first hop is allowlisted; the redirect goes to a loopback address that is not.
    target = f"http://127.0.0.2:{server.port}/img"
    with pytest.raises(FetchError, match=r"loopback address \(127\.0\.0\.2\)"):
        await fetch_image_bytes(server.url(f"/to?loc={target}"), LOCAL)
    assert server.hits == {"/to": 1}


async def test_redirect_to_name_resolving_private_refused(server):
    calls: list[str] = []
    resolver = stub_resolver({"img.test": ["127.0.0.1"], "internal.example": ["10.1.2.3"]}, calls)
    with pytest.raises(FetchError, match=r"private address \(10\.1\.2\.3\)"):
        await fetch_image_bytes(
            server.url("/to?loc=http://internal.example/secret.png", host="img.test"), LOCAL, resolver=resolver
        )
    assert calls == ["img.test", "internal.example"]
    assert server.hits == {"/to": 1}


async def test_redirect_scheme_rechecked(server):
    for loc in ("file:///etc/passwd", "data:image/png;base64,AAAA", "ftp://127.0.0.1/x"):
        with pytest.raises(FetchError, match=r"scheme file: is not allowed|scheme ftp: is not allowed|not an allowed http"):
            await fetch_image_bytes(server.url(f"/to?loc={loc}"), fetch_policy(allowed_hosts=("127.0.0.1",), allowed_local_dir="/"))
    http_only = fetch_policy(allowed_hosts=("127.0.0.1",), allowed_url_schemes=("http",))
    with pytest.raises(FetchError, match=r"scheme https: is not allowed"):
        await fetch_image_bytes(server.url(f"/to?loc=https://127.0.0.1:{server.port}/img"), http_only)


# ------------------------------------------------------------------------------- http: body and status


async def test_declared_content_length_over_the_cap_refused_before_reading(server):
    policy = fetch_policy(allowed_hosts=("127.0.0.1",), max_image_bytes=1000, fetch_timeout_s=5)
    start = time.monotonic()
    with pytest.raises(FetchError, match=r"image exceeds 1000 bytes \(Content-Length is 50000000\)"):
        await asyncio.wait_for(fetch_image_bytes(server.url("/big-declared"), policy), 5)
    assert time.monotonic() - start < 2  # the body (which stalls) was not awaited


async def test_streamed_body_over_the_cap_aborted(server):
    policy = fetch_policy(allowed_hosts=("127.0.0.1",), max_image_bytes=100_000, fetch_timeout_s=5)
    start = time.monotonic()
    with pytest.raises(FetchError, match=r"^image exceeds 100000 bytes$"):
        await asyncio.wait_for(fetch_image_bytes(server.url("/big-stream"), policy), 5)
    assert time.monotonic() - start < 2  # aborted at the cap, not at the timeout


async def test_body_exactly_at_the_cap_ok(server):
    policy = fetch_policy(allowed_hosts=("127.0.0.1",), max_image_bytes=len(PNG))
    assert await fetch_image_bytes(server.url("/img"), policy) == PNG
    with pytest.raises(FetchError, match="exceeds"):
        await fetch_image_bytes(server.url("/img"), fetch_policy(allowed_hosts=("127.0.0.1",), max_image_bytes=len(PNG) - 1))


async def test_slow_server_times_out_within_policy(server):
    policy = fetch_policy(allowed_hosts=("127.0.0.1",), fetch_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(FetchError, match=r"^image fetch timed out after 0\.5 s$"):
        await asyncio.wait_for(fetch_image_bytes(server.url("/slow"), policy), 5)
    assert 0.4 < time.monotonic() - start < 2


async def test_timeout_covers_the_whole_fetch_not_each_read(server):
    # Every byte arrives within 50 ms, so a per-read timeout would never fire; the policy's timeout
    # is for the whole fetch.
    policy = fetch_policy(allowed_hosts=("127.0.0.1",), fetch_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(FetchError, match="timed out after 0.5 s"):
        # wait_for: without a whole-fetch timeout this would never end; fail instead of hanging.
        await asyncio.wait_for(fetch_image_bytes(server.url("/drip"), policy), 5)
    assert time.monotonic() - start < 2


async def test_timeout_covers_resolution(guard):
    async def hanging(host: str, port: int) -> list[str]:
        await asyncio.sleep(30)
        return ["93.184.216.34"]

    with pytest.raises(FetchError, match="timed out after 0.3 s"):
        await asyncio.wait_for(
            fetch_image_bytes("http://slow-dns.example/", fetch_policy(fetch_timeout_s=0.3), client=guard, resolver=hanging), 5
        )


async def test_not_found_is_an_error(server):
    with pytest.raises(FetchError, match=r"^image fetch from 127\.0\.0\.1 failed: HTTP 404$"):
        await fetch_image_bytes(server.url("/404"), LOCAL)


async def test_compressed_response_refused(server):
    with pytest.raises(FetchError, match=r"compressed response \(gzip\)"):
        await fetch_image_bytes(server.url("/gzip"), LOCAL)


async def test_connection_refused_is_a_clean_error():
    # A port of 127.0.0.1 bound and held, never listened on: connecting to it is refused, and no other
    # process can take it meanwhile (a port found free and released could be, e.g. by Ray starting beside).
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(FetchError, match=r"^cannot connect to image host 127\.0\.0\.1 \(connection failed\)$"):
            await fetch_image_bytes(f"http://127.0.0.1:{port}/x.png", LOCAL)


# ------------------------------------------------------------------------------------- https pinning


def make_tls(tmp_path, name: str):
    """A throwaway CA and a server certificate for `name`; returns (server ctx, client ctx)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mmserve test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_file, key_file, ca_file = tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "ca.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert_file, key_file)
    client_ctx = ssl.create_default_context(cafile=str(ca_file))
    return server_ctx, client_ctx


async def test_https_pinned_ip_keeps_sni_and_certificate_check(tmp_path):
    server_ctx, client_ctx = make_tls(tmp_path, "img.test")
    sni_names: list[str | None] = []
    server_ctx.sni_callback = lambda sslobj, name, ctx: sni_names.append(name)
    srv, stop, runner = await start_server(server_ctx)
    try:
        resolver = stub_resolver({"img.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
        async with httpx.AsyncClient(verify=client_ctx, trust_env=False) as client:
            # Connects to 127.0.0.1, yet the handshake names img.test and the certificate for img.test
            # verifies: SNI and certificate checking follow the URL's host, not the pinned IP.
            got = await fetch_image_bytes(srv.url("/img", host="img.test", scheme="https"), LOCAL, client=client, resolver=resolver)
            assert got == PNG
            assert sni_names == ["img.test"]
            assert srv.host_headers == [f"img.test:{srv.port}"]
            # Same IP, another name: the img.test certificate does not match, so the fetch fails.
            with pytest.raises(FetchError, match="TLS certificate verification failed"):
                await fetch_image_bytes(
                    srv.url("/img", host="other.test", scheme="https"), LOCAL, client=client, resolver=resolver
                )
            assert srv.hits == {"/img": 1}
    finally:
        stop.set()
        await runner.cleanup()


# -------------------------------------------------------------------------------------------- file:


@pytest.fixture
def files(tmp_path):
    allowed = tmp_path / "allowed"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "cat.png").write_bytes(PNG)
    (allowed / "sub" / "dog.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(b"secret")
    return tmp_path, allowed


async def test_file_disabled_by_default(files):
    _, allowed = files
    url = (allowed / "cat.png").as_uri()
    with pytest.raises(FetchError, match=r"file:// image URLs are not allowed"):
        await fetch_image_bytes(url, fetch_policy())
    # Listing "file" as a scheme does not enable it either: allowed_local_dir does.
    with pytest.raises(FetchError, match=r"file:// image URLs are not allowed"):
        await fetch_image_bytes(url, fetch_policy(allowed_url_schemes=("http", "https", "data", "file")))


async def test_file_under_allowed_dir_ok(files):
    _, allowed = files
    policy = fetch_policy(allowed_local_dir=str(allowed))
    assert await fetch_image_bytes((allowed / "cat.png").as_uri(), policy) == PNG
    assert await fetch_image_bytes((allowed / "sub" / "dog.png").as_uri(), policy) == PNG
    assert await fetch_image_bytes(f"file://localhost{allowed}/cat.png", policy) == PNG
    # A symlink inside the directory pointing inside it is fine.
    os.symlink(allowed / "cat.png", allowed / "alias.png")
    assert await fetch_image_bytes((allowed / "alias.png").as_uri(), policy) == PNG


async def test_file_allowed_dir_given_through_a_symlink(files):
    tmp, allowed = files
    os.symlink(allowed, tmp / "link-to-allowed")
    policy = fetch_policy(allowed_local_dir=str(tmp / "link-to-allowed"))
    assert await fetch_image_bytes((allowed / "cat.png").as_uri(), policy) == PNG
    assert await fetch_image_bytes(f"file://{tmp}/link-to-allowed/cat.png", policy) == PNG


async def test_file_dotdot_escape_refused(files):
    tmp, allowed = files
    policy = fetch_policy(allowed_local_dir=str(allowed))
    for url in (f"file://{allowed}/../secret.png", f"file://{allowed}/sub/../../secret.png", f"file://{allowed}/%2e%2e/secret.png"):
        with pytest.raises(FetchError, match="outside the allowed directory"):
            await fetch_image_bytes(url, policy)
    with pytest.raises(FetchError, match="outside the allowed directory"):
        await fetch_image_bytes((tmp / "secret.png").as_uri(), policy)  # absolute path elsewhere
    with pytest.raises(FetchError, match="outside the allowed directory"):
        await fetch_image_bytes("file:///etc/hostname" if os.path.exists("/etc/hostname") else "file:///etc/passwd", policy)


async def test_file_prefix_sibling_refused(files):
    # /x/allowed-evil is not under /x/allowed even though the string starts with it.
    tmp, allowed = files
    sibling = tmp / "allowed-evil"
    sibling.mkdir()
    (sibling / "x.png").write_bytes(PNG)
    with pytest.raises(FetchError, match="outside the allowed directory"):
        await fetch_image_bytes((sibling / "x.png").as_uri(), fetch_policy(allowed_local_dir=str(allowed)))


async def test_file_symlink_escape_refused(files):
    tmp, allowed = files
    os.symlink(tmp / "secret.png", allowed / "innocent.png")
    os.symlink(tmp, allowed / "up")
    policy = fetch_policy(allowed_local_dir=str(allowed))
    with pytest.raises(FetchError, match="outside the allowed directory"):
        await fetch_image_bytes((allowed / "innocent.png").as_uri(), policy)
    with pytest.raises(FetchError, match="outside the allowed directory"):
        await fetch_image_bytes(f"file://{allowed}/up/secret.png", policy)


async def test_file_too_big_refused_from_stat(files, monkeypatch):
    _, allowed = files
    (allowed / "huge.png").write_bytes(b"\0" * 2000)
    with pytest.raises(FetchError, match=r"image exceeds 1000 bytes \(file is 2000\)"):
        await fetch_image_bytes((allowed / "huge.png").as_uri(), fetch_policy(allowed_local_dir=str(allowed), max_image_bytes=1000))


async def test_file_other_refusals(files):
    _, allowed = files
    policy = fetch_policy(allowed_local_dir=str(allowed))
    with pytest.raises(FetchError, match="not found"):
        await fetch_image_bytes((allowed / "missing.png").as_uri(), policy)
    with pytest.raises(FetchError, match="not a regular file"):
        await fetch_image_bytes((allowed / "sub").as_uri(), policy)
    with pytest.raises(FetchError, match="must not name a host"):
        await fetch_image_bytes(f"file://otherhost{allowed}/cat.png", policy)
    os.mkfifo(allowed / "fifo.png")
    with pytest.raises(FetchError, match="not a regular file"):
        await fetch_image_bytes((allowed / "fifo.png").as_uri(), policy)


def test_addresses_helper_sanity():
    reason = policy_module.non_public_reason
    assert reason(ipaddress.ip_address("93.184.216.34")) is None
    assert reason(ipaddress.ip_address("2606:4700::1111")) is None
    assert reason(ipaddress.ip_address("127.0.0.1")) == "loopback"

"""What the image fetcher may fetch: `FetchPolicy`, `FetchError`, the name resolver and the address rules (SSRF)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# resolver(host, port) -> the addresses the host resolves to, as strings ("93.184.216.34", "2606:2800::1").
Resolver = Callable[[str, int], Awaitable[Iterable[str]]]


class FetchError(ValueError):
    """The image URL was refused or could not be fetched; the message is safe to show to the client."""


@dataclass(frozen=True)
class FetchPolicy:
    max_image_bytes: int
    # Covers the whole fetch: name resolution, every redirect hop, and reading the body.
    fetch_timeout_s: float
    max_redirects: int
    allow_private_networks: bool
    # Host names (matched exactly, case-insensitively), IP addresses or CIDR networks (matched against
    # every resolved address) that are exempt from the private-address refusal.
    allowed_hosts: tuple[str, ...]
    # file:// URLs are refused unless this is set; then only files whose real path is under it are read.
    allowed_local_dir: str | None
    # Not configurable: what this code can fetch, and how it names itself.
    allowed_url_schemes: tuple[str, ...] = ("http", "https", "data")
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


def non_public_reason(address: IPAddress) -> str | None:
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
            inner = non_public_reason(embedded)
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

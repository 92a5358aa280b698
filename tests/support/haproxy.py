"""Where Serve's HAProxy forwards: the ingress replicas' own HTTP addresses, read from the config it was started with."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

_CONFIG_FLAG = re.compile(r"haproxy .*-f (\S+)")
_SERVER_LINE = re.compile(r"^\s*server \S+ (\d+\.\d+\.\d+\.\d+:\d+)", re.M)


def haproxy_config(command_line: str) -> Path | None:
    """The config file of an HAProxy started with `command_line` (None: not an HAProxy)."""
    found = _CONFIG_FLAG.search(command_line)
    return Path(found.group(1)) if found else None


def healthy_ingress_replica_url(config: Path, haproxy_port: int) -> str | None:
    """`http://ADDRESS` of the first server in HAProxy's `config` that answers /health with 200,
    leaving out HAProxy's own listening port (its frontend); None if none does."""
    for address in _SERVER_LINE.findall(config.read_text()):
        if address.endswith(f":{haproxy_port}"):
            continue
        try:
            if httpx.get(f"http://{address}/health", timeout=5).status_code == 200:
                return f"http://{address}"
        except httpx.HTTPError:
            continue
    return None

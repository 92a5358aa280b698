"""Plain settings of the transit layer, made from the application's config by `serve_app`.

Frozen dataclasses with no defaults: `serve_app/config.py` is the one home of every default
(tests/serve_app/test_defaults_one_home.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingSettings:
    """How the router chooses an engine (docs/configuration.md, `routing.*`)."""

    # Prefer the engine that served the same images or the longest shared prompt prefix.
    affinity: bool
    # An affine engine is chosen only if its load ≤ the least-loaded engine's + this.
    max_imbalance: int
    # Keys (image digests and prefix blocks) remembered, least recently used evicted first.
    affinity_entries: int
    # KV-cache usage at or above which an engine counts max_imbalance + 1 requests busier.
    kv_cache_full: float

"""Plain settings of the OpenAI serving layer, made from the application's config by `serve_app`.

Frozen dataclasses, so that the ingress replicas receive them pickled as they are and nothing
below `serve_app` reads its pydantic config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServingLimits:
    """Request limits the serving layer enforces (see README's configuration table)."""

    max_request_bytes: int = 4 * 1024 * 1024
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_chars: int = 512
    max_prompt_tokens: int | None = None
    max_messages: int = 1024
    max_content_parts: int = 256
    max_tools: int = 128
    max_prompt_chars: int | None = None
    # None: twice the largest body the caps allow (intake.default_body_budget).
    ingress_body_budget_bytes: int | None = None
    small_request_bytes: int = 64 * 1024
    body_read_timeout_s: float = 120.0


@dataclass(frozen=True)
class RoutingSettings:
    """How the router chooses an engine (see README's configuration table, `routing.*`)."""

    # Prefer the engine that served the same images or the longest shared prompt prefix.
    affinity: bool = True
    # An affine engine is chosen only if its load ≤ the least-loaded engine's + this.
    max_imbalance: int = 8
    # Keys (image digests and prefix blocks) remembered, least recently used evicted first.
    affinity_entries: int = 65536


@dataclass(frozen=True)
class ServingSettings:
    """What one ingress replica needs: the model, its name, the limits, image intake, access."""

    model_dir: Path
    model_name: str
    limits: ServingLimits = ServingLimits()
    # "device_normalize" or "host_normalize": what the engines expect (mmserve.multimodal.PixelMode).
    pixel_mode: str = "device_normalize"
    max_images_per_request: int = 8
    max_image_bytes: int = 20 * 1024 * 1024
    # How long a request waits for a starting engine before it gets a 503.
    engine_wait_timeout_s: float = 30.0
    routing: RoutingSettings = RoutingSettings()
    # None: no authentication (the ingress also reads MMSERVE_API_KEY).
    api_key: str | None = None

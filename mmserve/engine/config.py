"""How one engine client is configured: where it listens, how long it waits, how it watches its engine."""

from __future__ import annotations

from dataclasses import dataclass

from .mm_cache import EngineCacheSettings
from .transport import EngineAddresses


@dataclass(frozen=True)
class EngineClientConfig:
    """How one engine client waits and watches. No field has a default here: the application's
    config (`serve_app.config.AppConfig`) is their one home."""

    addresses: EngineAddresses
    # vLLM loads the model before it answers; a large model can take minutes.
    handshake_timeout_s: float
    health_check_interval_s: float
    # A utility call unanswered this long marks the engine hung. The engine answers between
    # model steps, so this must exceed the longest step (a long prefill on a big model).
    health_check_timeout_s: float
    # Diagnostics: keep the memory locations of the last N zero-copy frames sent (0 = off).
    trace_frames: int
    # The engine's multimodal processor cache (its launch flags): what the sender mirror copies.
    mm_cache: EngineCacheSettings

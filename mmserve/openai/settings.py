"""Plain settings of the OpenAI serving layer, made from the application's config by `serve_app`.

Frozen dataclasses, so that the ingress replicas receive them pickled as they are and nothing
below `serve_app` reads its pydantic config. No field has a default: `serve_app/config.py` is the one
home of every default (tests/serve_app/test_defaults_one_home.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mmserve.transit.settings import RoutingSettings


@dataclass(frozen=True)
class ServingLimits:
    """Request limits the serving layer enforces (docs/configuration.md)."""

    max_request_bytes: int
    max_n: int
    # -1: the whole vocabulary (vLLM's --max-logprobs).
    max_logprobs: int
    max_stop_strings: int
    max_stop_string_chars: int
    # None: the engine's max_model_len.
    max_prompt_tokens: int | None
    max_messages: int
    max_content_parts: int
    max_tools: int
    # None: the engine's max_model_len × the longest token's characters.
    max_prompt_chars: int | None
    # None: twice the largest body the caps allow (intake.default_body_budget).
    ingress_body_budget_bytes: int | None
    small_request_bytes: int
    body_read_timeout_s: float


@dataclass(frozen=True)
class ToolCallSettings:
    """A model's tool-call parsing (docs/configuration.md)."""

    # vLLM's --tool-call-parser: a name in `tool_parsers.TOOL_CALL_PARSERS`; None: no parser.
    parser: str | None
    # vLLM's --enable-auto-tool-choice: `tool_choice` "auto" (the default with tools) allowed.
    enable_auto_tool_choice: bool


@dataclass(frozen=True)
class ServingSettings:
    """What one ingress replica needs: the model, its name, the limits, image intake, access."""

    model_dir: Path
    model_name: str
    limits: ServingLimits
    # "device_normalize" or "host_normalize": what the engines expect (mmserve.multimodal.PixelMode).
    pixel_mode: str
    max_images_per_request: int
    max_image_bytes: int
    # How long a request waits for a starting engine before it gets a 503.
    engine_wait_timeout_s: float
    routing: RoutingSettings
    tool_calls: ToolCallSettings
    # vLLM's --reasoning-parser: a name in `reasoning_parsers.REASONING_PARSERS`; None: no reasoning split.
    reasoning_parser: str | None
    # None: no authentication (the ingress also reads MMSERVE_API_KEY).
    api_key: str | None
    # Changes whenever the preprocessor's settings do (`PreprocessorName.version`).
    preprocessor_version: str

"""Each part's settings as the application makes them from its defaults, for tests that build one
part on its own.

`serve_app/config.py` is the one home of every default; the settings dataclasses below it have none.
A test takes the settings the application would give and `dataclasses.replace`s what it varies, so
it runs against the defaults users get (and a changed default reaches every test).
"""

from __future__ import annotations

from dataclasses import replace
from collections.abc import Callable
from typing import Any

from deployments.engine_client_server import BuiltinEngineOptions, EngineClientSettings
from deployments.engine_client_server import engine_client_config as server_engine_client_config
from mmserve.builtin_engine import BuiltinEngineSettings, builtin_engine_command
from mmserve.engine import EngineAddresses, EngineClientConfig
from mmserve.engine.mm_cache import EngineCacheSettings
from mmserve.fetch import FetchPolicy
from mmserve.multimodal.preprocessor import PreprocessorLimits
from mmserve.openai.settings import ServingLimits, ServingSettings
from mmserve.transit.settings import RoutingSettings
from mmserve.vision import ImageLimits
from serve_app import settings as app_settings
from serve_app.config import AppConfig

APP = AppConfig()


def fetch_policy(**changes: Any) -> FetchPolicy:
    return replace(app_settings.fetch_policy(APP), **changes)


def preprocessor_limits(**changes: Any) -> PreprocessorLimits:
    return replace(app_settings.preprocessor_settings(APP).limits, **changes)


def image_limits(**changes: Any) -> ImageLimits:
    return replace(app_settings.preprocessor_settings(APP).limits.image, **changes)


def serving_settings(**changes: Any) -> ServingSettings:
    return replace(app_settings.serving_settings(APP), **changes)


def serving_limits(**changes: Any) -> ServingLimits:
    return replace(app_settings.serving_settings(APP).limits, **changes)


def routing_settings(**changes: Any) -> RoutingSettings:
    return replace(app_settings.serving_settings(APP).routing, **changes)


def engine_client_settings(**changes: Any) -> EngineClientSettings:
    """The built-in engine's client, as `serve run serve_app:app` starts it."""
    return replace(app_settings.engine_client_settings(APP, APP.engine_endpoints()[0]), **changes)


def builtin_engine_options(**changes: Any) -> BuiltinEngineOptions:
    options = engine_client_settings().builtin_engine
    assert options is not None
    return replace(options, **changes)


def engine_cache_settings(**changes: Any) -> EngineCacheSettings:
    return replace(engine_client_settings().mm_cache, **changes)


def engine_client_config(addresses: EngineAddresses, **changes: Any) -> EngineClientConfig:
    """What `EngineClientServer` gives its `EngineClient`, at the defaults."""
    settings = engine_client_settings(addresses=addresses)
    return replace(server_engine_client_config(settings, addresses.handshake), **changes)


def _builtin_engine_sizes() -> dict[str, Any]:
    """The built-in engine's sizes and step times as its engine client passes them."""
    options = builtin_engine_options()
    return {name: getattr(options, name) for name in (
        "max_model_len", "max_num_seqs", "step_interval_ms", "step_us_per_sequence", "step_us_per_prefill_token")}


def builtin_engine_settings(handshake_address: str, **changes: Any) -> BuiltinEngineSettings:
    """One built-in engine process's settings, as its engine client starts it."""
    return BuiltinEngineSettings(handshake_address=handshake_address, **{**_builtin_engine_sizes(), **changes})


def builtin_engine_argv(handshake: str, *, command: Callable[..., list[str]] = builtin_engine_command, **changes: Any) -> list[str]:
    """The argv of a built-in engine process sized as the application's defaults size it."""
    return command(handshake, **{**_builtin_engine_sizes(), **changes})

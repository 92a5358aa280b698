"""The application's config translated into each deployment's plain settings (nothing below `serve_app` reads `AppConfig`)."""

from __future__ import annotations

import hashlib
from dataclasses import fields
from typing import TypeVar

from pydantic import BaseModel

from deployments.engine_client_server import BuiltinEngineOptions, EngineClientSettings, EngineLaunchOptions
from deployments.engine_pool import EnginePoolScaling
from deployments.preprocessor import PreprocessorScaling, PreprocessorSettings
from mmserve.engine import EngineAddresses
from mmserve.engine.mm_cache import EngineCacheSettings
from mmserve.fetch import FetchPolicy
from mmserve.multimodal.preprocessor import PreprocessorLimits
from mmserve.openai.settings import ServingLimits, ServingSettings, ToolCallSettings
from mmserve.transit.settings import RoutingSettings
from mmserve.vision import ImageLimits

from .config import AppConfig, EngineEndpoint

Settings = TypeVar("Settings")


def _same_fields(settings_class: type[Settings], section: BaseModel) -> Settings:
    """`settings_class` (a dataclass) from the config section's fields of the same names."""
    return settings_class(**{field.name: getattr(section, field.name) for field in fields(settings_class)})  # type: ignore[arg-type]


def serving_settings(config: AppConfig) -> ServingSettings:
    """The ingress replicas' settings."""
    return ServingSettings(
        model_dir=config.model_dir,
        model_name=config.model_name,
        limits=_same_fields(ServingLimits, config.limits),
        pixel_mode=config.images.pixel_mode,
        max_images_per_request=config.images.max_images_per_request,
        max_image_bytes=config.images.max_image_bytes,
        engine_wait_timeout_s=config.engine_wait_timeout_s,
        api_key=config.api_key,
        routing=_same_fields(RoutingSettings, config.routing),
        tool_calls=ToolCallSettings(parser=config.tool_call_parser, enable_auto_tool_choice=config.enable_auto_tool_choice),
        reasoning_parser=config.reasoning_parser,
        preprocessor_version=hashlib.sha256(repr(preprocessor_settings(config)).encode()).hexdigest()[:16],
    )


def engine_client_settings(config: AppConfig, endpoint: EngineEndpoint) -> EngineClientSettings:
    """The settings of the engine client waiting for the engine at `endpoint`."""
    builtin = None
    if config.uses_builtin_engine:
        options = config.builtin_engine
        builtin = BuiltinEngineOptions(
            model_dir=config.model_dir,
            max_model_len=options.max_model_len,
            max_num_seqs=options.max_num_seqs,
            step_interval_ms=options.step_interval_ms,
            step_us_per_sequence=options.step_us_per_sequence,
            step_us_per_prefill_token=options.step_us_per_prefill_token,
        )
    return EngineClientSettings(
        addresses=EngineAddresses(endpoint.handshake, endpoint.inputs, endpoint.outputs),
        handshake_timeout_s=config.handshake_timeout_s,
        health_check_interval_s=config.health_check_interval_s,
        health_check_timeout_s=config.health_check_timeout_s,
        engine_wait_timeout_s=config.engine_wait_timeout_s,
        max_in_flight=config.limits.max_in_flight_per_engine,
        trace_wire_frames=config.trace_wire_frames,
        builtin_engine=builtin,
        mm_cache=EngineCacheSettings(endpoint.mm_processor_cache_gb, endpoint.mm_processor_cache_type),
        engine_launch=engine_launch_options(config),
    )


def engine_launch_options(config: AppConfig) -> EngineLaunchOptions | None:
    launch = config.engine_launch
    if launch is None:
        return None
    return EngineLaunchOptions(
        model=launch.model or str(config.model_dir),
        vllm_command=list(launch.vllm_command),
        engine_args=dict(launch.engine_args),
        resources=dict(launch.resources),
        env=dict(launch.env),
        restart_backoff_initial_s=launch.restart_backoff_initial_s,
        restart_backoff_max_s=launch.restart_backoff_max_s,
    )


def fetch_policy(config: AppConfig) -> FetchPolicy:
    images = config.images
    return FetchPolicy(
        max_image_bytes=images.max_image_bytes,
        fetch_timeout_s=images.fetch_timeout_s,
        max_redirects=images.max_redirects,
        allow_private_networks=images.allow_private_networks,
        allowed_hosts=tuple(images.allowed_hosts),
        allowed_local_dir=images.allowed_local_dir,
    )


def preprocessor_settings(config: AppConfig) -> PreprocessorSettings:
    images = config.images
    return PreprocessorSettings(
        model_dir=config.model_dir,
        fetch=fetch_policy(config),
        limits=PreprocessorLimits(
            max_images_per_request=images.max_images_per_request,
            image=ImageLimits(max_bytes=images.max_image_bytes, max_pixels=images.max_image_pixels),
            max_pixels_in_flight=images.pixels_in_flight,
        ),
        cache_bytes=images.cache_bytes,
        pixel_mode=images.pixel_mode,
        # As many as the cores Ray reserves for the replica: more threads on the same cores only add switching.
        pixel_threads=max(1, int(config.preprocessor.num_cpus)),
        max_ongoing_requests=config.preprocessor.max_ongoing_requests,
        max_queued_requests=config.preprocessor.max_queued_requests,
    )


def preprocessor_scaling(config: AppConfig) -> PreprocessorScaling:
    return _same_fields(PreprocessorScaling, config.preprocessor)


def engine_pool_scaling(config: AppConfig) -> EnginePoolScaling | None:
    return _same_fields(EnginePoolScaling, config.engine_pool) if config.engine_pool is not None else None

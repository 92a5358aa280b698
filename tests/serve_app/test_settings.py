"""The application's config reaches each deployment as plain settings, every key carried over."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from serve_app.config import AppConfig, RoutingConfig
from serve_app.settings import engine_client_settings, preprocessor_scaling, preprocessor_settings, serving_settings


def test_serving_settings_carry_every_limit_the_ingress_enforces():
    limits = {"max_request_bytes": 1, "max_n": 2, "max_stop_strings": 3, "max_stop_string_chars": 4, "max_prompt_tokens": 5,
              "max_messages": 6, "max_content_parts": 7, "max_tools": 8, "max_prompt_chars": 9,
              "ingress_body_budget_bytes": 10, "small_request_bytes": 11}
    config = AppConfig.model_validate({"limits": limits, "images": {"max_images_per_request": 3, "max_image_bytes": 12,
                                       "pixel_mode": "host_normalize"}, "api_key": "k", "engine_wait_timeout_s": 7.0,
                                       "served_model_name": "m"})
    settings = serving_settings(config)
    assert {name: getattr(settings.limits, name) for name in limits} == limits
    assert (settings.model_name, settings.api_key, settings.engine_wait_timeout_s) == ("m", "k", 7.0)
    assert (settings.pixel_mode, settings.max_images_per_request, settings.max_image_bytes) == ("host_normalize", 3, 12)


def test_engine_client_settings_start_the_builtin_engine_only_for_builtin():
    builtin = AppConfig.model_validate({"builtin_engine": {"max_model_len": 128, "step_interval_ms": 5.0},
                                        "limits": {"max_in_flight_per_engine": 9}, "trace_wire_frames": 4})
    settings = engine_client_settings(builtin, builtin.engine_endpoints()[0])
    assert settings.builtin_engine is not None and settings.builtin_engine.max_model_len == 128
    assert (settings.max_in_flight, settings.trace_wire_frames, settings.addresses.handshake) == (9, 4, "tcp://127.0.0.1:0")
    external = AppConfig.model_validate({"engines": "tcp://10.0.0.5:29550", "handshake_timeout_s": 3.0})
    settings = engine_client_settings(external, external.engine_endpoints()[0])
    assert settings.builtin_engine is None and settings.handshake_timeout_s == 3.0


def test_preprocessor_settings_and_options():
    config = AppConfig.model_validate({"images": {"allowed_hosts": ["a.example"], "max_image_pixels": 100, "cache_bytes": 0},
                                       "preprocessor": {"max_replicas": 2, "look_back_period_s": 4.0}})
    settings = preprocessor_settings(config)
    assert settings.fetch.allowed_hosts == ("a.example",) and settings.limits.image.max_pixels == 100 and settings.cache_bytes == 0
    assert settings.limits.max_pixels_in_flight == 200  # by default two of the largest images
    explicit = AppConfig.model_validate({"images": '{"max_pixels_in_flight": 30000000}'})  # as from the CLI
    assert preprocessor_settings(explicit).limits.max_pixels_in_flight == 30_000_000
    assert isinstance(settings.model_dir, Path)
    assert (settings.max_ongoing_requests, settings.max_queued_requests) == (8, 64)  # the replica admits (ReplicaAdmission)
    options = preprocessor_scaling(config).options()
    autoscaling = options["autoscaling_config"]
    assert autoscaling.max_replicas == 2 and autoscaling.metrics_interval_s == 1.0
    assert autoscaling.policy.policy_function == "deployments.preprocessor_autoscaling.preprocessor_load_policy"
    assert options["request_router_config"].request_router_class == "deployments.replica_router.NamedReplicaRouter"
    # Serve's own limit leaves room for the requests the replica admits and the engine clients' attachments.
    assert options["max_ongoing_requests"] > 8 + 64


def test_routing_settings_reach_the_router_and_bad_values_are_refused():
    import pydantic
    import pytest

    from mmserve.transit.settings import RoutingSettings

    assert dataclasses.asdict(serving_settings(AppConfig()).routing) == RoutingConfig().model_dump()
    config = AppConfig.model_validate(
        {"routing": '{"affinity": false, "max_imbalance": 0, "affinity_entries": 5, "kv_cache_full": 0.5}'}  # as from the CLI
    )
    assert serving_settings(config).routing == RoutingSettings(affinity=False, max_imbalance=0, affinity_entries=5, kv_cache_full=0.5)
    for bad in ({"max_imbalance": -1}, {"affinity_entries": 0}, {"affinity_weight": 1}, {"kv_cache_full": 0}, {"kv_cache_full": 1.5}):
        with pytest.raises(pydantic.ValidationError):
            AppConfig.model_validate({"routing": bad})
    with pytest.raises(pydantic.ValidationError):
        AppConfig.model_validate({"cors_allow_origins": ["https://a.example"]})  # removed: it was never read


def test_tool_call_settings_reach_the_ingress_and_unusable_ones_are_refused():
    import pydantic
    import pytest

    from mmserve.openai.settings import ToolCallSettings

    assert serving_settings(AppConfig()).tool_calls == ToolCallSettings(parser=None, enable_auto_tool_choice=False)
    config = AppConfig.model_validate({"tool_call_parser": "hermes", "enable_auto_tool_choice": "true"})  # as from the CLI
    assert serving_settings(config).tool_calls == ToolCallSettings(parser="hermes", enable_auto_tool_choice=True)
    with pytest.raises(pydantic.ValidationError, match="unknown tool_call_parser 'qwen'; this server has \\['hermes'\\]"):
        AppConfig.model_validate({"tool_call_parser": "qwen"})
    with pytest.raises(pydantic.ValidationError, match="enable_auto_tool_choice needs tool_call_parser"):
        AppConfig.model_validate({"enable_auto_tool_choice": True})


def test_the_reasoning_parser_reaches_the_ingress_and_an_unknown_one_is_refused():
    import pydantic
    import pytest

    assert serving_settings(AppConfig()).reasoning_parser is None
    for name in ("deepseek_r1", "qwen3"):
        assert serving_settings(AppConfig.model_validate({"reasoning_parser": name})).reasoning_parser == name
    with pytest.raises(pydantic.ValidationError, match="unknown reasoning_parser 'qwen'; this server has \\['deepseek_r1', 'qwen3'\\]"):
        AppConfig.model_validate({"reasoning_parser": "qwen"})


def test_the_preprocessor_version_the_ingress_names_changes_with_the_preprocessor_settings_only():
    """Engine clients recall what a preprocessor answered for an image only under the same version
    (`PreprocessorName.version`): any change of how images are fetched, limited or processed is a
    new one (an engine application's engine clients outlive a redeploy of the mmserve application)."""
    version = lambda config: serving_settings(AppConfig.model_validate(config)).preprocessor_version  # noqa: E731
    base = version({})
    assert base and version({}) == base
    assert version({"limits": {"max_n": 3}, "api_key": "k"}) == base
    for images in ({"max_image_pixels": 100}, {"max_image_bytes": 1000}, {"allowed_hosts": ["a.example"]}, {"cache_bytes": 0}):
        assert version({"images": images}) != base, images

"""`engine_pool` configuration: for engines the application starts, bounds that make sense, and the
Serve options it becomes (Serve's autoscaling on the engines' held requests, the pool's request router,
a drain as long as asked for)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.engine_pool_autoscaling import EngineSaturationPolicy
from serve_app.config import AppConfig
from serve_app.settings import engine_pool_scaling


def test_a_pool_of_built_in_or_launched_engines_becomes_serve_autoscaling_options():
    config = AppConfig.model_validate({"engine_pool": '{"min_engines": 2, "max_engines": 5, "target_requests_per_engine": 8, "drain_timeout_s": 90}'})
    options = engine_pool_scaling(config).options()
    scaling = options["autoscaling_config"]
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (2, 2, 5, 8)
    assert scaling.policy.policy_function == "deployments.engine_pool_autoscaling.EngineSaturationPolicy"
    assert scaling.policy.policy_kwargs == {"target_kv_cache_usage": 0.8}
    assert options["request_router_config"].request_router_class == "deployments.engine_pool.EngineReplicaRouter"
    assert options["graceful_shutdown_timeout_s"] == 90 and options["num_replicas"] == "auto"
    launched = AppConfig.model_validate({"model": "/m", "engine_launch": {"resources": {"CPU": 2}}, "engine_pool": {}})
    assert engine_pool_scaling(launched).max_engines == 4
    assert engine_pool_scaling(AppConfig.model_validate({})) is None


def test_a_pool_is_refused_where_it_would_do_nothing_or_could_not_work():
    with pytest.raises(ValidationError, match="engines started elsewhere"):
        AppConfig.model_validate({"engines": ["tcp://127.0.0.1:5"], "engine_pool": {}})
    with pytest.raises(ValidationError, match="count does nothing with engine_pool"):
        AppConfig.model_validate({"model": "/m", "engine_launch": {"count": 2}, "engine_pool": {}})
    with pytest.raises(ValidationError, match="port must be 0"):
        AppConfig.model_validate({"builtin_engine": {"handshake": "tcp://127.0.0.1:5555"}, "engine_pool": {}})
    with pytest.raises(ValidationError, match="below min_engines"):
        AppConfig.model_validate({"engine_pool": {"min_engines": 3, "max_engines": 2}})
    with pytest.raises(ValidationError):
        AppConfig.model_validate({"engine_pool": {"min_engines": 0}})  # the ingress needs an engine to answer
    with pytest.raises(ValidationError):
        AppConfig.model_validate({"engine_pool": {"target_requests_per_engine": 0}})
    with pytest.raises(ValidationError):
        AppConfig.model_validate({"engine_pool": {"target_kv_cache_usage": 1.5}})  # a fraction
    assert engine_pool_scaling(AppConfig.model_validate({"engine_pool": {"target_kv_cache_usage": None}})).target_kv_cache_usage is None


class _Config:
    def get_target_ongoing_requests(self) -> float:
        return 4.0


class _Context:
    def __init__(self, held: dict[str, float] | None, current: int, kv_usage: dict[str, float] | None = None) -> None:
        self.aggregated_metrics = {"engine_requests": held} if held is not None else {}
        if kv_usage is not None:
            self.aggregated_metrics["engine_kv_cache_usage"] = kv_usage
        self.current_num_replicas = current
        self.config = _Config()


def test_the_policy_wants_engines_for_the_requests_the_engines_hold():
    policy = EngineSaturationPolicy(target_kv_cache_usage=None)
    assert policy(_Context({"a": 16.0}, 1))[0] == 4.0  # Serve rounds up and bounds it
    assert policy(_Context({"a": 3.0, "b": 2.0}, 2))[0] == 1.25
    assert policy(_Context({"a": 0.0, "b": 0.0}, 2))[0] == 0.0  # down to min_engines
    assert policy(_Context(None, 3))[0] == 3  # nothing reported yet: stay
    assert policy(_Context({"a": 2.0}, 1, {"a": 0.99}))[0] == 0.5  # KV usage not a term: off


def test_the_policy_wants_engines_for_the_kv_cache_the_engines_fill():
    policy = EngineSaturationPolicy(target_kv_cache_usage=0.8)
    # Two long requests fill one engine's cache: their count alone would want half an engine.
    assert policy(_Context({"a": 2.0}, 1, {"a": 0.96}))[0] == pytest.approx(1.2)
    assert policy(_Context({"a": 2.0, "b": 1.0}, 2, {"a": 0.9, "b": 0.7}))[0] == pytest.approx(2.0)
    assert policy(_Context({"a": 16.0}, 1, {"a": 0.1}))[0] == 4.0  # the larger need wins
    assert policy(_Context({"a": 2.0}, 1))[0] == 0.5  # no scheduler stats yet: requests only

"""The application builder: it says so when Ray was started without HAProxy (Serve's Python proxy on the
request path); the front end's replicas ask for the Ray resources the config names."""

from __future__ import annotations

import logging

import pytest

from deployments.pixel_store import OBJECT_REF_ENV
from deployments.replica_env import INGRESS_REPLICA_ENV, PIXEL_REPLICA_ENV
from serve_app import leftovers
from serve_app.builder import HA_PROXY_FLAG, build_app


@pytest.fixture(autouse=True)
def _no_reaper(monkeypatch):
    """Building here is no `serve run` about to start Ray: no reaper waiting for pytest to end."""
    monkeypatch.setattr(leftovers, "start_reaper", lambda pid: None)


@pytest.mark.parametrize("flag", [None, "1"])
def test_a_missing_ha_proxy_flag_is_warned_about(flag, monkeypatch, caplog):
    if flag is None:
        monkeypatch.delenv(HA_PROXY_FLAG, raising=False)
    else:
        monkeypatch.setenv(HA_PROXY_FLAG, flag)
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        build_app({})
    warned = [r for r in caplog.records if HA_PROXY_FLAG in r.getMessage()]
    assert bool(warned) == (flag is None)


def _ingress_and_preprocessor(args: dict):
    ingress = build_app(args)._bound_deployment
    [preprocessor] = [arg._bound_deployment for arg in ingress.init_args if hasattr(arg, "_bound_deployment")]
    return ingress.ray_actor_options, preprocessor.ray_actor_options


def test_the_front_ends_replicas_ask_for_the_resources_the_config_names():
    """What keeps them off the engines' nodes on a cluster (`cluster/serve_launch.yaml`)."""
    front_end = {"mmserve_front_end": 0.001}
    ingress, preprocessor = _ingress_and_preprocessor({"ingress_resources": front_end, "preprocessor": {"resources": front_end, "num_cpus": 2}})
    assert ingress["resources"] == front_end and preprocessor["resources"] == front_end
    assert preprocessor["num_cpus"] == 2
    # The ingress keeps its runtime environment and CPUs whatever the resources.
    assert ingress["runtime_env"] == {"env_vars": INGRESS_REPLICA_ENV} and ingress["num_cpus"] == 0.5
    assert _ingress_and_preprocessor({}) == ({"num_cpus": 0.5, "resources": {}, "runtime_env": {"env_vars": INGRESS_REPLICA_ENV}},
                                             {"num_cpus": 1.0, "resources": {}, "runtime_env": {"env_vars": PIXEL_REPLICA_ENV}})


@pytest.mark.parametrize("args", [{}, {"engine_pool": {"min_engines": 1, "max_engines": 2}}], ids=["engine-clients", "engine-pool"])
def test_the_replicas_holding_pixel_references_refuse_to_pickle_them_out_of_band(args):
    """A reference pickled outside a Ray call would pin its pixels for the preprocessor's life
    (`deployments/pixel_store.py`): where references are held, Ray is told to raise instead."""
    ingress = build_app(args)._bound_deployment
    bound = [arg._bound_deployment for arg in ingress.init_args if hasattr(arg, "_bound_deployment")]
    bound += [arg._bound_deployment for value in ingress.init_args if isinstance(value, list) for arg in value]
    names = {deployment.name: deployment.ray_actor_options["runtime_env"] for deployment in bound}
    assert names.keys() == {"Preprocessor", "EnginePool" if args else "EngineClient0"}
    assert all(env == {"env_vars": PIXEL_REPLICA_ENV} and OBJECT_REF_ENV.items() <= env["env_vars"].items() for env in names.values())

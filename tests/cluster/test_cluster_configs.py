"""The cluster files parse, and every Serve config in them is one Ray Serve and our builder accept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from serve_app.config import AppConfig

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"


def _serve_configs() -> list[tuple[str, dict]]:
    configs = [(p.name, yaml.safe_load(p.read_text())) for p in sorted(CLUSTER.glob("serve_*.yaml"))]
    for path in sorted(CLUSTER.glob("kuberay-*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "RayService":
                configs.append((path.name, yaml.safe_load(doc["spec"]["serveConfigV2"])))
    return configs


@pytest.mark.parametrize(("name", "config"), _serve_configs(), ids=lambda v: v if isinstance(v, str) else "")
def test_serve_configs_validate(name, config):
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(config)
    for app in schema.applications:
        assert app.import_path in ("serve_app:build_app", "serve_app:app", "serve_app:build_engine_app")
        config = AppConfig.model_validate(app.args or {})
        if app.import_path == "serve_app:build_engine_app":
            # One engine, reached through Serve only, named as its mmserve application's prefix says.
            assert app.route_prefix is None and len(config.engine_endpoints()) == 1
            prefixes = [a.args["engine_applications"] for a in schema.applications if (a.args or {}).get("engine_applications")]
            assert any(app.name.startswith(prefix) for prefix in prefixes), app.name


@pytest.mark.parametrize(("name", "config"), _serve_configs(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_mmserve_application_runs_two_ingress_replicas_at_least(name, config):
    """Losing an ingress replica is then no outage: HAProxy sends new requests to the other."""
    fronts = [app for app in config["applications"] if app["import_path"] != "serve_app:build_engine_app"]
    assert fronts
    for app in fronts:
        assert AppConfig.model_validate(app.get("args") or {}).ingress_replicas >= 2, f"{name}: {app['name']}"


def test_launcher_config_shape():
    config = yaml.safe_load((CLUSTER / "ray-cluster.yaml").read_text())
    assert config["head_node_type"] in config["available_node_types"]
    assert {"cluster_name", "provider", "setup_commands", "head_start_ray_commands"} <= set(config)
    assert "mmserve_engine_host" in config["available_node_types"][config["head_node_type"]]["resources"]


def test_engines_launched_by_the_app_scale_in_every_deployment_file():
    """Issue 20: the Serve config, the cluster-launcher config and the RayService for launched engines
    all autoscale them: an engine pool bounded like the GPU node group that hosts its engines."""
    serve_launch = yaml.safe_load((CLUSTER / "serve_launch.yaml").read_text())["applications"][0]["args"]
    launcher = yaml.safe_load((CLUSTER / "ray-cluster-gpu.yaml").read_text())
    service = next(d for d in yaml.safe_load_all((CLUSTER / "kuberay-rayservice-launch.yaml").read_text()) if d and d["kind"] == "RayService")
    kuberay = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    gpu_group = next(g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "gpu")
    for args in (serve_launch, kuberay):
        assert args["engine_launch"]["resources"]["GPU"] == 1 and "count" not in args["engine_launch"]
        assert args["engine_pool"]["min_engines"] >= 1
    assert launcher["available_node_types"]["gpu_worker"]["max_workers"] == serve_launch["engine_pool"]["max_engines"]
    assert launcher["available_node_types"]["gpu_worker"]["min_workers"] == 0
    assert {"head", "cpu_worker", "gpu_worker"} <= set(launcher["available_node_types"])
    assert service["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    assert gpu_group["maxReplicas"] == kuberay["engine_pool"]["max_engines"] and gpu_group["minReplicas"] == 0


def test_with_launched_engines_the_front_end_stays_off_the_engines_nodes():
    """Serve spreads replicas over every node with room: the ingress and preprocessor replicas ask for a
    custom resource that the head and CPU nodes have and the GPU nodes (the engines') do not."""
    serve_launch = yaml.safe_load((CLUSTER / "serve_launch.yaml").read_text())["applications"][0]["args"]
    launcher = yaml.safe_load((CLUSTER / "ray-cluster-gpu.yaml").read_text())["available_node_types"]
    service = next(d for d in yaml.safe_load_all((CLUSTER / "kuberay-rayservice-launch.yaml").read_text()) if d and d["kind"] == "RayService")
    kuberay = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    cluster = service["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: json.loads(yaml.safe_load(g["rayStartParams"].get("resources", "'{}'"))) for g in cluster["workerGroupSpecs"]}
    groups["head"] = json.loads(yaml.safe_load(cluster["headGroupSpec"]["rayStartParams"]["resources"]))
    for args, nodes, front_end_nodes, engine_nodes in (
        (serve_launch, {name: t["resources"] for name, t in launcher.items()}, ("head", "cpu_worker"), ("gpu_worker",)),
        (kuberay, groups, ("head", "cpu"), ("gpu",)),
    ):
        config = AppConfig.model_validate(args)
        for resources in (config.preprocessor.resources, config.ingress_resources):
            assert resources and set(resources) <= {"mmserve_front_end"}
            for node in front_end_nodes:
                assert all(nodes[node].get(name, 0) >= amount for name, amount in resources.items()), node
            for node in engine_nodes:
                assert not set(resources) & set(nodes[node]), node


def test_kuberay_manifest_shape():
    docs = [d for d in yaml.safe_load_all((CLUSTER / "kuberay-rayservice.yaml").read_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert {"RayService", "Service", "Deployment"} <= kinds
    service = next(d for d in docs if d["kind"] == "RayService")
    assert service["spec"]["rayClusterConfig"]["rayVersion"].startswith("2.60")


def _ray_env() -> dict[str, str]:
    lines = (CLUSTER / "ray.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


@pytest.mark.parametrize("name", ["ray-cluster.yaml", "ray-cluster-gpu.yaml"])
def test_every_ray_start_of_a_cluster_launcher_file_takes_the_ray_instances_settings_from_ray_env(name):
    config = yaml.safe_load((CLUSTER / name).read_text())
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands") for c in config[key] if "ray start" in c]
    assert len(starts) == 2 and all("env $(grep -v '^#' /opt/mmserve/cluster/ray.env)" in c for c in starts), starts


@pytest.mark.parametrize("name", ["kuberay-rayservice.yaml", "kuberay-rayservice-launch.yaml"])
def test_every_ray_container_of_a_kuberay_file_has_ray_envs_settings(name):
    """(A manifest cannot read the file: its containers list the same settings, checked here.)"""
    service = next(d for d in yaml.safe_load_all((CLUSTER / name).read_text()) if d and d["kind"] == "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", []) if "value" in e}
            assert _ray_env().items() <= env.items(), (name, container["name"])

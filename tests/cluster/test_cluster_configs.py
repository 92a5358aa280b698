"""The cluster files parse, and every Serve config in them is one Ray Serve and our builder accept."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from serve_app.config import AppConfig

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"


def _serve_configs() -> list[tuple[str, dict]]:
    configs = [(p.name, yaml.safe_load(p.read_text())) for p in sorted(CLUSTER.glob("serve_*.yaml"))]
    for doc in yaml.safe_load_all((CLUSTER / "kuberay-rayservice.yaml").read_text()):
        if doc and doc.get("kind") == "RayService":
            configs.append(("kuberay-rayservice.yaml", yaml.safe_load(doc["spec"]["serveConfigV2"])))
    return configs


@pytest.mark.parametrize(("name", "config"), _serve_configs(), ids=lambda v: v if isinstance(v, str) else "")
def test_serve_configs_validate(name, config):
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(config)
    for app in schema.applications:
        assert app.import_path in ("serve_app:build_app", "serve_app:app")
        AppConfig.model_validate(app.args or {})


def test_launcher_config_shape():
    config = yaml.safe_load((CLUSTER / "ray-cluster.yaml").read_text())
    assert config["head_node_type"] in config["available_node_types"]
    assert {"cluster_name", "provider", "setup_commands", "head_start_ray_commands"} <= set(config)
    assert "mmserve_engine_host" in config["available_node_types"][config["head_node_type"]]["resources"]


def test_kuberay_manifest_shape():
    docs = [d for d in yaml.safe_load_all((CLUSTER / "kuberay-rayservice.yaml").read_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert {"RayService", "Service", "Deployment"} <= kinds
    service = next(d for d in docs if d["kind"] == "RayService")
    assert service["spec"]["rayClusterConfig"]["rayVersion"].startswith("2.60")

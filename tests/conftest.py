"""Session-wide fixtures: one Ray instance with Serve, and applications deployed on it.

Ray is small here (the machine has 2 cores): logical CPUs are scheduling labels only.
Each application gets its own route prefix, so the built-in-engine app and the real-vLLM
app run side by side in the same Serve instance.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@dataclass
class ServeInstance:
    http_port: int

    def url(self, prefix: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{prefix}"


@dataclass
class DeployedApp:
    name: str
    base_url: str  # ends with the route prefix; OpenAI base_url is base_url + "/v1"

    def engine_handle(self, index: int = 0):
        from ray import serve

        return serve.get_deployment_handle(f"EngineClient{index}", app_name=self.name)

    def engine_info(self, index: int = 0):
        return self.engine_handle(index).info.remote().result(timeout_s=30)

    def engine_utility(self, method: str, *args: Any, index: int = 0) -> Any:
        return self.engine_handle(index).call_utility.remote(method, *args).result(timeout_s=30)

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, **kwargs)

    def async_openai(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, **kwargs)


@pytest.fixture(scope="session")
def serve_instance() -> Iterator[ServeInstance]:
    import ray
    from ray import serve

    from tests.support.vllm_engines import free_tcp_port

    port = free_tcp_port()
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        object_store_memory=512 * 1024**2,
        log_to_driver=bool(os.environ.get("MMSERVE_TEST_RAY_LOGS")),
        runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "VLLM_TARGET_DEVICE": "cpu"}},
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield ServeInstance(http_port=port)
    serve.shutdown()
    ray.shutdown()


def deploy_app(instance: ServeInstance, name: str, args: dict[str, Any], *, ready_timeout_s: float = 120.0) -> DeployedApp:
    """Deploy `serve_app.build_app(args)` under /NAME and wait until /health says ready."""
    import httpx
    from ray import serve

    from serve_app import build_app

    serve.run(build_app(args), name=name, route_prefix=f"/{name}", blocking=False)
    app = DeployedApp(name=name, base_url=instance.url(f"/{name}"))
    deadline = time.monotonic() + ready_timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(app.base_url + "/health", timeout=5)
            if last.status_code == 200:
                return app
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.5)
    raise TimeoutError(f"app {name} not healthy after {ready_timeout_s} s: {getattr(last, 'text', last)}")


@pytest.fixture(scope="session")
def builtin_app(serve_instance: ServeInstance) -> DeployedApp:
    return deploy_app(serve_instance, "builtin", {"builtin_engine": {"step_interval_ms": 2.0}})

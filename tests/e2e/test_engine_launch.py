"""Engines launched on Ray by the application (`engine_launch`): a real `vllm serve --headless` CPU
engine started by a Ray actor in its engine client's STRICT_PACK placement group (same node, loopback),
serving requests; killed, it is restarted by its launcher and rejoins with no manual step (requests in
flight on it get a clear error); after the application is deleted no process of any engine it ran is
left (listed from /proc); a launcher lost makes its replica unhealthy, and Serve replaces it."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import openai
import pytest
from ray import serve

from tests.conftest import TINY_MODEL_NAME, deploy_app
from tests.e2e.fault_support import wait_for
from tests.support.processes import pid_gone
from tests.support.reference_venv import reference_python
from tests.support.vllm_reference import VLLM_CPU_ENV, WORKER_IN_ENGINE_CORE

pytestmark = pytest.mark.serve


def _alive(pid: int) -> bool:
    return not pid_gone(pid)


def _engine_processes(port: int) -> list[int]:
    """Processes whose command line names the engine's handshake port (the engine's launcher process)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if b"--data-parallel-rpc-port" in argv and argv[argv.index(b"--data-parallel-rpc-port") + 1] == str(port).encode():
                found.append(int(entry))
    return found


def _chat(app, text: str, max_tokens: int = 8):
    return app.openai(timeout=120).chat.completions.create(
        model=TINY_MODEL_NAME, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0.0)


def _answers(app) -> bool:
    try:
        return _chat(app, "hello again").choices[0].finish_reason in ("stop", "length")
    except openai.APIError:
        return False


@pytest.mark.real_engine
def test_launched_engine_serves_restarts_and_leaves_nothing(serve_instance, tiny_qwen2_vl_dir):
    name = "launched"
    # The tests' engine settings (the launcher starts the command line it is given, whatever it runs).
    env = {**VLLM_CPU_ENV, **WORKER_IN_ENGINE_CORE}
    args = {
        "model": str(tiny_qwen2_vl_dir), "served_model_name": TINY_MODEL_NAME,
        "handshake_timeout_s": 600, "health_check_timeout_s": 20,
        "engine_launch": {
            "count": 1,
            "engine_args": {"max-model-len": 1024, "enforce-eager": True, "dtype": "bfloat16", "seed": 0},
            "resources": {"CPU": 1},
            "env": env,
            # The gateway (this venv) launches vLLM installed elsewhere: the reference venv's.
            "vllm_command": [reference_python(), "-m", "vllm.entrypoints.cli.main"],
            "restart_backoff_initial_s": 0.5,
        },
    }
    seen: set[int] = set()
    port = None
    try:
        app = deploy_app(serve_instance, name, args, ready_timeout_s=900)
        first = _chat(app, "hello")
        assert first.usage.completion_tokens > 0
        handle = app.engine_handle(0)
        status = handle.launcher_status.remote().result(timeout_s=30)
        info = app.engine_info()
        port = int(info.handshake_address.rsplit(":", 1)[1])
        assert info.handshake_address.startswith("tcp://127.0.0.1:"), info  # loopback: same node
        assert status["starts"] == 1 and len(status["tree"]) >= 2, status  # vllm serve + its EngineCore
        # (Colocation of engine and engine client is not checked here: this cluster has one node,
        # where any two node ids are equal. tests/e2e/test_multinode_colocation.py places them.)
        seen.update(status["tree"])
        assert _engine_processes(port) == [status["tree"][0]]

        # Kill the engine's whole process tree: a crash, as far as anyone can tell.
        for pid in status["tree"]:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: app.engine_info().state != "ready", 30, "engine client noticed the crash")
        wait_for(lambda: _answers(app), 900, "the relaunched engine serves", interval_s=2.0)
        status = handle.launcher_status.remote().result(timeout_s=30)
        assert status["starts"] == 2, status
        assert status["exits"] and status["exits"][0] == -signal.SIGKILL, status
        assert app.engine_info().state == "ready"
        seen.update(status["tree"])
    finally:
        serve.delete(name, _blocking=True)
    # Nothing of either engine is left, nor anything naming its port.
    wait_for(lambda: not any(_alive(pid) for pid in seen), 30, f"engine processes {sorted(seen)} gone")
    if port is not None:
        wait_for(lambda: not _engine_processes(port), 30, "no process names the engine's port")


def _deploy_with_shim(serve_instance, name: str, **extra):
    """An app whose launched engine is the built-in engine behind a `vllm serve`-shaped command line
    (seconds instead of minutes), and a function that asks it for a short chat."""
    from serve_app.config import BUILTIN_MODEL_DIR

    shim = os.path.join(os.path.dirname(__file__), "..", "support", "builtin_as_vllm.py")
    launch = {"engine_args": {"max-model-len": 2048}, "resources": {"CPU": 1}, "vllm_command": [sys.executable, shim],
              **extra.pop("engine_launch", {})}
    app = deploy_app(serve_instance, name, {"model": str(BUILTIN_MODEL_DIR), "served_model_name": "mmserve-builtin",
                                            "engine_launch": launch, **extra}, ready_timeout_s=120)
    chat = lambda: app.openai(timeout=30).chat.completions.create(  # noqa: E731
        model="mmserve-builtin", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    return app, chat


def test_launched_engine_declared_hung_is_killed_and_restarted(serve_instance):
    """The same launcher with the built-in engine behind a `vllm serve`-shaped command line (seconds
    instead of minutes): a SIGSTOPped engine is declared hung by its engine client, the launcher
    kills it and starts a new one at once, and the service answers again with no manual step."""
    name = "launched-hang"
    seen: set[int] = set()
    try:
        app, chat = _deploy_with_shim(serve_instance, name, health_check_interval_s=0.5, health_check_timeout_s=1.0,
                                      engine_launch={"restart_backoff_initial_s": 30})
        assert chat().usage.completion_tokens > 0
        handle = app.engine_handle(0)
        status = handle.launcher_status.remote().result(timeout_s=30)
        seen.update(status["tree"])
        for pid in status["tree"]:
            os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        wait_for(lambda: handle.launcher_status.remote().result(timeout_s=30)["starts"] == 2, 30, "launcher restarted the hung engine")
        # The restart was asked for (back-off is 30 s: an exit-driven restart would not be this quick).
        assert time.monotonic() - stopped_at < 20
        wait_for(lambda: app.engine_info().state == "ready", 60, "new engine ready")
        assert chat().usage.completion_tokens > 0
        status = handle.launcher_status.remote().result(timeout_s=30)
        assert status["restarts_requested"] == 1 and status["exits"] == [-signal.SIGKILL], status
        assert not any(_alive(pid) for pid in seen)
        seen.update(status["tree"])
    finally:
        serve.delete(name, _blocking=True)
    wait_for(lambda: not any(_alive(pid) for pid in seen), 30, f"engine processes {sorted(seen)} gone")


@pytest.mark.parametrize("deployment", ["EngineClient0", "EnginePool"])
def test_a_lost_launcher_makes_its_replica_unhealthy_and_serve_replaces_it(serve_instance, deployment):
    """A launcher is never restarted by Ray (its engine dies with it). Killed with `ray.kill`, its engine
    client says why once, fails its health checks, and Serve replaces the replica: a new launcher and
    engine, and the service answers again with no manual step. The same in an engine pool (one
    engine), whose replicas are the same engine client."""
    import ray

    name = f"launcher-lost-{deployment.lower()}"
    seen: set[int] = set()
    try:
        pool = {"engine_pool": {"min_engines": 1, "max_engines": 1}} if deployment == "EnginePool" else {}
        app, chat = _deploy_with_shim(serve_instance, name, **pool)
        assert chat().usage.completion_tokens > 0
        handle = serve.get_deployment_handle(deployment, app_name=name)  # (a pool of one: a call naming no engine reaches it)
        first = handle.launcher_status.remote().result(timeout_s=30)
        seen.update(first["tree"])
        ray.kill(ray.get_actor(first["launcher_name"], namespace="serve"), no_restart=True)

        def replaced() -> bool:
            status = handle.launcher_status.remote().result(timeout_s=10)
            return status["launcher_name"] != first["launcher_name"] and handle.info.remote().result(timeout_s=10).state == "ready"

        wait_for(replaced, 120, "Serve replaced the replica whose launcher was lost, and its new engine is ready")
        # The ingress learns of the new replica on its own (a request in between may get a 503).
        wait_for(lambda: chat().usage.completion_tokens > 0, 60, "the service answers again", interval_s=0.5)
        assert not any(_alive(pid) for pid in seen)  # the lost launcher's engine went with it
        seen.update(handle.launcher_status.remote().result(timeout_s=30)["tree"])
        logs_dir = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
        logs = "".join(p.read_text(errors="replace") for p in logs_dir.glob(f"replica_{name}_{deployment}_*.log"))
        # Said once, with the reason (Serve's failed health checks then quote it in their own lines).
        said = [line for line in logs.splitlines() if "failing health checks so that Serve replaces this replica" in line]
        assert len(said) == 1 and "its engine launcher is gone (" in said[0], said
    finally:
        serve.delete(name, _blocking=True)
    wait_for(lambda: not any(_alive(pid) for pid in seen), 30, f"engine processes {sorted(seen)} gone")

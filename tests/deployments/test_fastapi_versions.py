"""The service works on the oldest and the newest FastAPI the project allows, installed as a user would.

The oldest is ray[serve] 2.60's own lower bound (read from ray's metadata; pyproject.toml states the
same), the newest the one ./scripts/lock.sh resolved (scripts/constraints/gateway.txt). The venv is
the one README's quick start made in a fresh clone (tests/support/quick_start.py), which served with
the newest; the oldest is then installed over it, with a clean `pip check`, and a real `serve run`
must answer /v1/models, a chat completion and a streamed chat with 200; the pinned FastAPI is put
back afterwards for the quick start test. FastAPI 0.137.0 is where routes started to be analysed
lazily in the replica (see deployments/ingress.py), so the two ends straddle that change.
"""

import importlib.metadata
import tomllib

import httpx
import pytest
from packaging.requirements import Requirement

from tests.support.serve_process import GATEWAY_CONSTRAINTS, REPO, ServeRunProcess, pinned_version, run_logged

pytestmark = pytest.mark.serve


def ray_fastapi_lower_bound() -> str:
    for text in importlib.metadata.requires("ray") or []:
        req = Requirement(text)
        if req.name == "fastapi" and req.marker is not None and req.marker.evaluate({"extra": "serve"}):
            (lower,) = [s.version for s in req.specifier if s.operator == ">="]
            return lower
    raise LookupError("ray[serve] declares no fastapi lower bound")


def pyproject_fastapi_lower_bound() -> str:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "fastapi"]
    (lower,) = [s.version for s in req.specifier if s.operator == ">="]
    return lower


def test_pyproject_allows_exactly_what_ray_serve_allows_at_the_bottom():
    assert pyproject_fastapi_lower_bound() == ray_fastapi_lower_bound()


def exercise(base_url: str) -> None:
    models = httpx.get(base_url + "/v1/models", timeout=30)
    assert models.status_code == 200, models.text
    model = models.json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}
    chat = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", base_url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as stream:
        assert stream.status_code == 200, stream.read()
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 2


def test_quick_start_install_serves_with_the_newest_fastapi(quick_start):
    # The quick start served from this venv (models, chats, streamed and with an image, all 200).
    installed = run_logged([str(quick_start.bin_dir / "python"), "-c", "import fastapi; print(fastapi.__version__)"], timeout_s=60)
    assert installed.stdout.strip() == pinned_version("fastapi")


def test_quick_start_install_serves_with_the_oldest_fastapi(quick_start, tmp_path):
    python = str(quick_start.bin_dir / "python")
    version = ray_fastapi_lower_bound()
    # The pins with FastAPI swapped for the version under test, installed over the quick start's.
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(
        "".join(line + "\n" for line in GATEWAY_CONSTRAINTS.read_text().splitlines() if not line.lower().startswith("fastapi=="))
    )
    run_logged([python, "-m", "pip", "install", "-q", "-c", str(constraints), f"fastapi=={version}"], timeout_s=600)
    try:
        installed = run_logged([python, "-c", "import fastapi; print(fastapi.__version__)"], timeout_s=60)
        assert installed.stdout.strip() == version
        run_logged([python, str(REPO / "scripts" / "check_gateway_venv.py")], timeout_s=120)
        with ServeRunProcess.from_venv(quick_start.bin_dir, REPO, tmp_path / "serve.log") as serve:
            exercise(serve.base_url)
    finally:  # the quick start's own install again, for the tests that share the venv
        run_logged([python, "-m", "pip", "install", "-q", "-c", str(GATEWAY_CONSTRAINTS), f"fastapi=={pinned_version('fastapi')}"], timeout_s=600)

"""Session-wide fixtures: one Ray instance with Serve, and applications deployed on it.

Ray is small here (the machine has 2 cores): logical CPUs are scheduling labels only.
Each application gets its own route prefix, so the built-in-engine app and the real-vLLM
app run side by side in the same Serve instance.

The suite runs in two parts (scripts/test.sh): from the gateway venv `.venv` (README's quick start
install, no vllm/torch/transformers) with `-m "not reference"`, which is where every Serve
application runs; and from the reference venv `.venv-ref` with `-m reference`: the tests listed in
REFERENCE_TESTS, which call vLLM's or Hugging Face's own functions in the pytest process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _pytest.mark.expression import Expression

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


# --------------------------------------------------------------------------- the two venvs

# Tests that import vllm, torch or transformers in the pytest process (their own comparisons with
# vLLM's or Hugging Face's functions) get the `reference` marker: a whole file ("*"), or the tests of
# a file by function name. Tests using a fixture of REFERENCE_FIXTURES are reference tests too.
# Engines, vLLM's offline reference and the tiny-model builders run as reference-venv *processes*
# (tests/support/reference_venv.py), so the tests that only start them stay in the gateway part.
REFERENCE_TESTS: dict[str, str | set[str]] = {
    "tests/engine/test_mm_cache_mirror.py": "*",
    "tests/multimodal/test_family_pixels.py": "*",
    "tests/support_tests/test_vllm_tooling.py": "*",
    "tests/text/test_stop_strings.py": "*",
    "tests/text/test_tokenizer_classes.py": "*",
    "tests/text/test_tool_templates.py": "*",
    "tests/text/test_template_kwargs.py": "*",
    "tests/text/test_chat_template.py": {"test_content_format_detection_matches_vllm", "test_content_format_detection_variants"},
    "tests/openai/test_vllm_request_fields.py": {
        "test_tables_cover_vllm_request_models", "test_openai_fields_vllm_ignores_are_ignored_here_and_listed_in_the_api_reference"
    },
    "tests/openai/test_tool_calls.py": {"test_refusals_word_for_word_as_vllm"},
    "tests/openai/test_tool_call_parsing.py": "*",
    "tests/openai/test_reasoning_parsing.py": "*",
    "tests/openai/test_structured_output_checks.py": "*",
    "tests/vision/test_fast_paths.py": "*",
    "tests/vision/test_image_io.py": "*",
    "tests/vision/test_llava.py": "*",
    "tests/vision/test_qwen2_vl.py": "*",
    "tests/vision/test_resize.py": "*",
    "tests/wire/test_vllm_interop.py": "*",
}
# Modules that run on Ray clusters of their own, apart from the Ray instance the other gateway tests
# share (README's quick start in a fresh clone, `serve run`, a multi-node cluster; the launcher tests,
# mostly waiting on replicas and engines being replaced, on their process's own instance):
# scripts/test.sh runs them (`-m own_cluster`) in a pytest process of their own, beside the other
# gateway tests, which leave the cores idle while they wait on engines and replicas. The tests with
# tight time bounds (`background_settled`) wait until that process is done (OWN_CLUSTER_PART_DONE).
OWN_CLUSTER_TESTS = {
    "tests/test_quickstart.py",
    "tests/deployments/test_fastapi_versions.py",
    "tests/e2e/test_default_limits.py",
    "tests/e2e/test_engine_applications_deploy.py",
    "tests/e2e/test_engine_launch.py",
    "tests/e2e/test_multinode_colocation.py",
    "tests/e2e/test_ray_start_engine_pool.py",
    "tests/e2e/test_cross_node_pixels.py",
    "tests/e2e/test_serve_run_logs.py",
    "tests/e2e/test_serve_run_ingress_env.py",
    "tests/e2e/test_serve_run_stops.py",
    "tests/e2e/test_ingress_replica_loss.py",
}
# Own-cluster modules too heavy to share the machine (a multi-node cluster of real vLLM engines beside
# the whole suite overloads 2 cores: its nodes missed their health checks and were declared dead):
# scripts/test.sh runs them after every other part has ended, alone (`-m alone`).
ALONE_TESTS = {"tests/e2e/test_ray_start_engine_pool.py", "tests/e2e/test_cross_node_pixels.py"}
# What the other gateway tests share and an own-cluster test must not use (its process would make a
# second copy: a second vLLM server and engine, a second app).
SESSION_SHARED_FIXTURES = {"builtin_app", "vllm_app", "vllm_serve_reference"}
# A file scripts/test.sh creates when the own-cluster process has ended.
OWN_CLUSTER_PART_DONE = "MMSERVE_OWN_CLUSTER_PART_DONE"
REFERENCE_FIXTURES = {
    "hf_tokenizer",  # tests/text/conftest.py: transformers' AutoTokenizer
    "vllm_codec",  # tests/builtin_engine/test_builtin_engine.py: vLLM's msgpack codec and structs
}
_TESTS_ROOT = Path(__file__).resolve().parent


def _relative(path: Path) -> str:
    return str(Path("tests") / Path(path).resolve().relative_to(_TESTS_ROOT))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "reference: imports vllm/torch/transformers in-process; runs from .venv-ref")
    config.addinivalue_line("markers", "own_cluster: runs on Ray clusters of its own, beside the other gateway tests")
    config.addinivalue_line("markers", "alone: an own-cluster test run after all the others, with the machine to itself")


def _excludes_reference(config: pytest.Config) -> bool:
    """True when `-m` leaves out every reference test (the gateway part: `-m "not reference"`)."""
    markexpr = config.getoption("markexpr")
    if not markexpr:
        return False
    expression = Expression.compile(markexpr)
    # Reference, whatever other markers it has.
    return not any(expression.evaluate(lambda name, other=other, **_: name == "reference" or other) for other in (False, True))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # Whole reference files import vllm/torch/transformers at module level: never even import them
    # in the gateway part.
    if collection_path.suffix == ".py" and collection_path.is_relative_to(_TESTS_ROOT):
        if REFERENCE_TESTS.get(_relative(collection_path)) == "*" and _excludes_reference(config):
            return True
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        listed = REFERENCE_TESTS.get(_relative(item.path))
        name = getattr(item, "originalname", item.name)
        if listed == "*" or (listed and name in listed) or REFERENCE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.reference)
        if _relative(item.path) in ALONE_TESTS:
            item.add_marker(pytest.mark.alone)
        if _relative(item.path) in OWN_CLUSTER_TESTS:
            item.add_marker(pytest.mark.own_cluster)
            shared = SESSION_SHARED_FIXTURES & set(getattr(item, "fixturenames", ()))
            if shared:  # it would make its own copy of them in its own process
                raise pytest.UsageError(f"{item.nodeid} is listed in OWN_CLUSTER_TESTS but uses {sorted(shared)}")
    group: dict[Path, int] = {}
    for item in items:  # a module runs whole, in the group of its latest-grouped test
        group[item.path] = max(group.get(item.path, 0), _run_group(item))
    items.sort(key=lambda item: group[item.path])  # stable: within a group, collection order


def _run_group(item: pytest.Item) -> int:
    """Modules run in five groups, so that the work started in the background after collection
    (pytest_collection_finish) is done by the time it is needed, and never beside tight time bounds:
    0. unit tests (no `serve` marker), while the shared vLLM processes boot;
    1. modules using them (the session app's engine waits at most FRESH_ENGINE_S for its handshake);
    2. the other Serve tests, while the quick start, the other models and the offline references are made;
    3. modules using those;
    4. modules with tight time bounds, which wait until all of it is done (`background_settled`)."""
    names = set(getattr(item, "fixturenames", ()))
    if "background_settled" in names:
        return 4
    if names & {"vllm_app", "vllm_serve_reference"}:
        return 1
    if names & BACKGROUND_FIXTURES:
        return 3
    return 2 if item.get_closest_marker("serve") else 0


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


# --------------------------------------------------------------------------- real vLLM engine

from tests.support.session_vllm import TINY_MODEL_NAME, TOOL_CALL_PARSER  # noqa: E402 - after the environment above

_SESSION_VLLM = pytest.StashKey["SessionVllm"]()
_QUICK_START = pytest.StashKey["BackgroundQuickStart"]()


# The tiny models' fixtures, by the model directory each returns (tests/support/tiny_models.py).
MODEL_FIXTURES = {
    "tiny_qwen2_vl_dir": TINY_MODEL_NAME,
    "tiny_qwen2_5_vl_dir": "tiny-qwen2_5_vl",
    "tiny_qwen3_vl_dir": "tiny-qwen3_vl",
    "tiny_llava_dir": "tiny-llava",
    "tiny_thinking_dir": "tiny-thinking-qwen2-vl",
}


# Fixtures whose work starts in the background right after collection, and `background_settled`,
# which waits for all of it (for tests with tight time bounds).
BACKGROUND_FIXTURES = {*MODEL_FIXTURES, "session_vllm", "vllm_app", "vllm_serve_reference", "quick_start", "background_settled"}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start now what the selected tests need and takes long, so that it is done while the first tests
    run on the other core: the tiny models and the shared vLLM processes (tests/support/session_vllm.py),
    README's quick start (tests/support/quick_start.py)."""
    if session.config.option.collectonly:
        return
    used = set().union(*(getattr(item, "fixturenames", ()) for item in session.items))
    models = [MODEL_FIXTURES[name] for name in sorted(used & MODEL_FIXTURES.keys())]
    modules = {item.module for item in session.items if isinstance(item, pytest.Function)}
    references = [r for module in sorted(modules, key=lambda m: m.__name__) for r in getattr(module, "OFFLINE_REFERENCES", ())]
    if models or references:
        _start_session_vllm(
            session.config, models=models, offline_references=references,
            reference_server="vllm_serve_reference" in used, app_engine="vllm_app" in used,
        )  # fmt: skip
    # Not in the own-cluster process (scripts/test.sh): there each test starts a Ray cluster of its own,
    # and the quick start's `serve run`, starting one beside them and the gateway part's, timed out
    # ("The current node timed out during startup"). Its first test runs it then.
    own_cluster_only = all(item.get_closest_marker("own_cluster") for item in session.items)
    if "quick_start" in used and not own_cluster_only:
        _start_quick_start(session.config)


def _start_session_vllm(config: pytest.Config, **wanted: Any):
    import tempfile

    from tests.support.session_vllm import SessionVllm

    if _SESSION_VLLM not in config.stash:
        config.stash[_SESSION_VLLM] = SessionVllm(Path(tempfile.mkdtemp(prefix="mmserve-session-vllm-")), **wanted)
    return config.stash[_SESSION_VLLM]


def _start_quick_start(config: pytest.Config) -> "BackgroundQuickStart":
    import tempfile

    from tests.support.quick_start import BackgroundQuickStart

    if _QUICK_START not in config.stash:
        config.stash[_QUICK_START] = BackgroundQuickStart(Path(tempfile.mkdtemp(prefix="mmserve-quickstart-")))
    return config.stash[_QUICK_START]


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _QUICK_START in session.config.stash:
        session.config.stash[_QUICK_START].close()  # it stops its own `serve run`
    if _SESSION_VLLM in session.config.stash:
        session.config.stash[_SESSION_VLLM].stop()


@pytest.fixture(scope="session")
def background_settled(pytestconfig) -> None:
    """Waits until the work started after collection is done (the shared vLLM processes booted, the
    quick start stopped) and the own-cluster tests have ended in their process: tests with tight time
    bounds must not share the cores with them."""
    if _SESSION_VLLM in pytestconfig.stash:
        pytestconfig.stash[_SESSION_VLLM].wait_started()
    if _QUICK_START in pytestconfig.stash:
        pytestconfig.stash[_QUICK_START].wait()
    done = os.environ.get(OWN_CLUSTER_PART_DONE)
    deadline = time.monotonic() + 1800
    while done and not Path(done).exists() and time.monotonic() < deadline:
        time.sleep(1.0)


@pytest.fixture(scope="session")
def session_vllm(pytestconfig):
    return _start_session_vllm(pytestconfig, models=[], reference_server=False, app_engine=False)


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(session_vllm) -> Path:
    return session_vllm.model_dir(MODEL_FIXTURES["tiny_qwen2_vl_dir"])


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_dir(session_vllm) -> Path:
    return session_vllm.model_dir(MODEL_FIXTURES["tiny_qwen2_5_vl_dir"])


@pytest.fixture(scope="session")
def tiny_qwen3_vl_dir(session_vllm) -> Path:
    return session_vllm.model_dir(MODEL_FIXTURES["tiny_qwen3_vl_dir"])


@pytest.fixture(scope="session")
def tiny_llava_dir(session_vllm) -> Path:
    return session_vllm.model_dir(MODEL_FIXTURES["tiny_llava_dir"])


@pytest.fixture(scope="session")
def tiny_thinking_dir(session_vllm) -> Path:
    return session_vllm.model_dir(MODEL_FIXTURES["tiny_thinking_dir"])


@dataclass
class VllmBackedApp:
    app: DeployedApp
    engine: Any  # tests.support.vllm_engines.HeadlessVllmEngine
    model_dir: "Path"
    model_name: str = TINY_MODEL_NAME


@pytest.fixture(scope="session")
def vllm_app(serve_instance: ServeInstance, session_vllm, tiny_qwen2_vl_dir) -> Iterator[VllmBackedApp]:
    """The Serve graph in front of a real `vllm serve --headless` CPU engine (tiny Qwen2-VL)."""
    engine = session_vllm.app_engine()
    try:
        app = deploy_app(
            serve_instance,
            "vllm",
            {
                "model": str(tiny_qwen2_vl_dir),
                "served_model_name": TINY_MODEL_NAME,
                "engines": [engine.handshake_address],
                "handshake_timeout_s": 600,
                # CPU engine on a 2-core machine shared with the tests: generous but bounded. 20 s was
                # too short: with the own-cluster part installing the quick start beside it, the engine
                # left a health check unanswered for over 20 s right after the client-disconnect test
                # (the first logprobs request next), was declared hung, and as an external engine never
                # came back, failing every later test on this app (also at fc46708); 90 s passes.
                "health_check_timeout_s": 90,
                # As the reference `vllm serve` (tests/support/session_vllm.py).
                "tool_call_parser": TOOL_CALL_PARSER,
                "enable_auto_tool_choice": True,
            },
            ready_timeout_s=600,
        )
    except BaseException:
        print(engine.log_tail())
        raise
    yield VllmBackedApp(app=app, engine=engine, model_dir=tiny_qwen2_vl_dir)
    engine.stop()


@pytest.fixture(scope="session")
def vllm_serve_reference(session_vllm):
    """`vllm serve` on the same tiny Qwen2-VL with the same engine flags as `vllm_app`'s engine:
    the answers mmserve must equal (tests/support/serve_reference.py)."""
    from tests.support.serve_reference import ServeReference

    return ServeReference(session_vllm.reference_server(), TINY_MODEL_NAME)


# --------------------------------------------------------------------------- README's quick start


@pytest.fixture(scope="session")
def quick_start(pytestconfig):
    """README's quick start, run once in a fresh clone (tests/support/quick_start.py), in the
    background from the end of collection; its venv is a user's fresh install, shared by the tests
    that need one."""
    return _start_quick_start(pytestconfig).result()

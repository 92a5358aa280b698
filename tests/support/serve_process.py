"""`serve run` as a user runs it: a separate process from a given venv, on its own Ray instance.

Used by the tests that check what an install gives a user (README's quick start, the FastAPI
versions the project allows, the resize path reported by a running service). Each process gets
its own HTTP port and its own process group, so stopping it never touches another Ray cluster.
"""

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.support.vllm_engines import free_tcp_port

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS_DIR = REPO / "scripts" / "constraints"
GATEWAY_CONSTRAINTS = CONSTRAINTS_DIR / "gateway.txt"


def pinned_version(package: str, constraints: Path = GATEWAY_CONSTRAINTS) -> str:
    for line in constraints.read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and name.strip().lower().replace("_", "-") == package.lower():
            return version.strip()
    raise LookupError(f"{package} is not pinned in {constraints}")


def run_logged(cmd: list[str], *, timeout_s: float, cwd: Path | None = None, env: dict | None = None, shell: bool = False):
    """Run a command; on failure raise with its output (pip's resolver errors are the useful part)."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, shell=shell, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


RAY_INSTANCE_ENV = REPO / "cluster" / "ray.env"


def ray_instance_settings() -> dict[str, str]:
    """The Ray instance's settings (`cluster/ray.env`, which README's quick start and `cluster/` give to
    whatever starts Ray): every `serve run` of the suite starts its Ray instance with them, as a user does."""
    settings = {}
    for line in RAY_INSTANCE_ENV.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            settings[name.strip()] = value.strip()
    if settings.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        raise AssertionError(f"{RAY_INSTANCE_ENV} lost HAProxy: {settings}")
    return settings


def serve_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "VIRTUAL_ENV", "PYTHONPATH"))}
    # As README starts it; the suite's own Ray instances without token authentication (its tests
    # attach drivers to them).
    env.update(ray_instance_settings(), RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    # Stopping: no 30 s deregistration window per ingress replica (docs/operations.md, "HAProxy: ports, stopping, a known limit").
    env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "0"
    return env


# Ray 2.60 gives a starting node 30 s (a constant of `ray._private.node`) to register with its GCS. On
# 2 cores running the whole suite's parts at once that once ran out for three `serve run`s in a row
# (load average ≈9): such a start is made again, once, as a user would rerun the command.
RAY_NODE_START_TIMED_OUT = "The current node timed out during startup"


def sigint_as_default() -> None:
    """`preexec_fn` of a `serve run`: SIGINT back to its default. A process started in the background
    by a non-interactive shell (CI runners, `cmd &`) inherits SIGINT ignored, and Python then never
    raises the KeyboardInterrupt that makes `serve run` shut down: it ran until killed."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class ServeRunProcess:
    """`serve run` started from `command` (a shell command line) in `cwd`; its log goes to `log_path`.

    The HTTP port is set through a Serve config file when the command names one ({config}); README's
    quick start has the default port 8000 baked in, so it is run as written and the port is 8000.
    """

    def __init__(self, command: str, cwd: Path, log_path: Path, port: int, env: dict[str, str] | None = None) -> None:
        self.command, self.cwd, self.log_path, self.port = command, cwd, log_path, port
        self.env = env or serve_env()
        self.proc: subprocess.Popen | None = None

    @classmethod
    def from_venv(cls, bin_dir: Path, cwd: Path, log_path: Path, import_path: str = "serve_app:app") -> "ServeRunProcess":
        port = free_tcp_port()
        config = log_path.with_suffix(".yaml")
        config.write_text(
            f"http_options: {{host: 127.0.0.1, port: {port}}}\n"
            f"applications:\n- name: app\n  route_prefix: /\n  import_path: {import_path}\n"
        )
        return cls(f"{bin_dir / 'serve'} run {config}", cwd, log_path, port)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_timeout_s: float = 600, *, again_if_ray_start_times_out: bool = True) -> "ServeRunProcess":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            ["bash", "-c", self.command], cwd=self.cwd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=sigint_as_default,
        )
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if again_if_ray_start_times_out and RAY_NODE_START_TIMED_OUT in self.log_text():
                    self._log.close()
                    try:
                        os.killpg(self.proc.pid, signal.SIGKILL)  # the daemons the failed start left
                    except ProcessLookupError:
                        pass
                    first = self.log_path.with_name(self.log_path.name + ".first-attempt")
                    self.log_path.replace(first)
                    print(f"`{self.command}`: Ray's node start timed out (log: {first}); starting it again, once")
                    return self.start(ready_timeout_s, again_if_ray_start_times_out=False)
                raise AssertionError(f"`{self.command}` exited {self.proc.returncode} before serving:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise AssertionError(f"`{self.command}` not healthy after {ready_timeout_s} s:\n{self.log_tail()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 8000) -> str:
        return self.log_text()[-chars:]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)  # serve run shuts down Serve and the Ray instance it started
        try:
            self.proc.wait(timeout=45)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        finally:
            self._log.close()
        # Ray's own daemons (raylet, GCS) are in the same session; make sure none outlives the test.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "ServeRunProcess":
        # `with ServeRunProcess(...).start(...) as p` must not start a second process.
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

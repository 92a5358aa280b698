"""A real `serve run` of the mmserve app in a subprocess, on a Ray instance of its own.

`RAY_TMPDIR` gives it its own temp root, so its session (logs, sockets) is never another
cluster's `session_latest`, and `ray.init()` inside `serve run` starts a fresh local instance
rather than joining one that happens to run on the machine. Everything runs in one process group,
stopped as a whole.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.haproxy import haproxy_config, healthy_ingress_replica_url
from tests.support.serve_process import ray_instance_settings, sigint_as_default
from tests.support.vllm_engines import free_tcp_port

REPO = Path(__file__).resolve().parents[2]


class ServeRun:
    def __init__(
        self, args: dict[str, Any], *, env: dict[str, str] | None = None, deployments: list[dict[str, Any]] | None = None,
    ) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="i8sr", dir="/tmp"))  # short: Ray's socket paths
        self.port = free_tcp_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = {
            "proxy_location": "HeadOnly",
            "http_options": {"host": "127.0.0.1", "port": self.port},
            "applications": [{"name": "mmserve", "import_path": "serve_app:build_app", "route_prefix": "/", "args": args}],
        }
        if deployments is not None:  # a Serve config's per-deployment options, over the application's
            config["applications"][0]["deployments"] = deployments
        self.config_path = self.tmp / "serve.json"
        self.config_path.write_text(json.dumps(config))
        self.log_path = self.tmp / "serve_run.log"
        self.env = {
            **os.environ,
            "RAY_TMPDIR": str(self.tmp),
            "RAY_USAGE_STATS_ENABLED": "0",
            # As README starts it: HAProxy in front of the ingress replicas' own HTTP servers, and
            # Serve's intervals.
            **ray_instance_settings(),
            # Stopping: no 30 s deregistration window per ingress replica (docs/operations.md, "HAProxy: ports, stopping, a known limit").
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
            "PYTHONPATH": str(REPO),
            **(env or {}),
        }
        self.env.pop("RAY_ADDRESS", None)
        self.proc: subprocess.Popen | None = None

    def start(self, ready_timeout_s: float = 300.0) -> "ServeRun":
        serve_cli = Path(sys.executable).with_name("serve")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(serve_cli), "run", str(self.config_path)], cwd=REPO, env=self.env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=sigint_as_default,
            )
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve run exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"serve run not healthy after {ready_timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    @property
    def serve_log_dir(self) -> Path:
        return self.tmp / "ray" / "session_latest" / "logs" / "serve"

    def replica_logs(self, deployment: str) -> str:
        """The text of every log file of `deployment`'s replicas (e.g. "Ingress", "Preprocessor")."""
        return "".join(p.read_text(errors="replace") for p in sorted(self.serve_log_dir.glob(f"replica_*_{deployment}_*.log")))

    def all_serve_logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.serve_log_dir.glob("*.log")))

    def worker_stderr(self) -> str:
        logs = self.tmp / "ray" / "session_latest" / "logs"
        return "".join(p.read_text(errors="replace") for p in sorted(logs.glob("worker-*.err")))

    def ingress_replica_url(self) -> str:
        """The HTTP address of an ingress replica's own server (Serve's direct ingress), read from the
        config of this run's HAProxy (a process of this run's session), behind which it serves."""
        ps = subprocess.run(["ps", "-ww", "-eo", "pid=,sid=,args="], capture_output=True, text=True, check=True).stdout
        for line in ps.splitlines():
            pid, sid, args = line.split(None, 2)
            config = haproxy_config(args)
            if int(sid) != self.proc.pid or config is None:
                continue
            if (url := healthy_ingress_replica_url(config, self.port)) is not None:
                return url
        raise LookupError(f"no ingress replica found behind this run's HAProxy:\n{ps}")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.kill(self.proc.pid, signal.SIGINT)  # serve run shuts the app and its Ray down
            self.proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever outlived it in the group
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        if not os.environ.get("MMSERVE_KEEP_SERVE_RUN"):  # set it to read a failed run's logs
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "ServeRun":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def request_log_lines(text: str) -> list[dict]:
    """The JSON objects of the `mmserve.requests` lines in a replica log."""
    out = []
    for line in text.splitlines():
        if "mmserve.requests" not in line and "request {" not in line:
            continue
        start = line.find("request {")
        if start == -1:
            continue
        payload = line[start + len("request "):]
        try:
            out.append(json.loads(payload[: payload.rfind("}") + 1]))
        except ValueError:
            continue
    return out

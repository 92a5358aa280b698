"""A process of the reference venv that has imported vLLM once and forks every vLLM process the tests
start: `vllm serve` command lines and the offline reference's child.

A vLLM start-up on this 2-core machine is mostly imports (torch, transformers and vLLM: ≈ 8–10 s of
CPU in each new interpreter), paid again by the process `vllm serve` spawns for its EngineCore. The
suite starts some thirty engines, servers and offline references; forked from here, each costs its
model set-up only. What runs in the child is vLLM's own code from its own entry points (the CLI's
`main()`, `LLM`), with two differences from a start from the shell: the interpreter is already warm,
and the EngineCore is forked from the CLI process rather than spawned (vLLM's CPU platform asks for
`spawn` because OpenMP state does not survive a fork; with `OMP_NUM_THREADS=1`, the tests' setting,
no OpenMP thread pool exists to break). Benchmarks and the product's launcher start vLLM as users do.

Protocol (one JSON line each way per connection, on a Unix socket):
    {"op": "start", "argv": [...], "env": {...}, "cwd": "...", "log": "..."} -> {"pid": N}
        argv is either ["vllm", ...] (the CLI) or ["offline-reference", JOB, OUT]
    {"op": "status", "pid": N} -> {"returncode": int | null}
The child runs in a session of its own (`setsid`): signals to its process group reach all of it.
`ZygoteClient` is the tests' side; `ZygoteChild` mimics the part of `subprocess.Popen` the tests use.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------ server
def _serve(socket_path: str) -> None:
    import multiprocessing

    # Everything an engine, a server or an offline reference imports, once, before any fork. Nothing
    # here runs a torch operator: no OpenMP thread pool exists when the children are forked.
    import vllm.entrypoints.cli.main  # noqa: F401
    import vllm.entrypoints.cli.serve  # noqa: F401
    import vllm.entrypoints.openai.api_server  # noqa: F401
    import vllm.v1.engine.core  # noqa: F401
    import vllm.v1.engine.utils
    import vllm.v1.executor.uniproc_executor  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401
    from vllm import LLM  # noqa: F401

    statuses: dict[int, int] = {}
    children: set[int] = set()

    def reap(*_):
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            statuses[pid] = os.waitstatus_to_exitcode(status)

    signal.signal(signal.SIGCHLD, reap)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        with conn, conn.makefile("rw") as stream:
            request = json.loads(stream.readline())
            if request["op"] == "status":
                reap()
                pid = request["pid"]
                reply = {"returncode": statuses.get(pid) if pid not in children else None}
            else:
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    _child(request, multiprocessing)
                children.add(pid)
                reply = {"pid": pid}
            stream.write(json.dumps(reply) + "\n")
            stream.flush()


def _child(request: dict, multiprocessing) -> None:
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # the child's temporary files follow its own TMPDIR, not the zygote's
        os.chdir(request["cwd"])
        argv = request["argv"]
        if argv[0] == "offline-reference":
            from tests.support.vllm_reference import compute_offline_reference

            compute_offline_reference(argv[1], argv[2])
            code = 0
        else:
            import vllm.v1.engine.utils as engine_utils
            from vllm.entrypoints.cli.main import main

            # The EngineCore forked from this warm process, not spawned (see the module's docstring).
            engine_utils.get_mp_context = lambda: multiprocessing.get_context("fork")
            sys.argv = argv
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the child's log, which the tests show
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# ------------------------------------------------------------------------------------------ client
class ZygoteChild:
    """A process the zygote forked: the part of `subprocess.Popen`'s interface the tests use."""

    def __init__(self, client: ZygoteClient, pid: int):
        self._client = client
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._client.request({"op": "status", "pid": self.pid})["returncode"]
        return self.returncode

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout)
            time.sleep(0.1)
        return self.returncode


class ZygoteClient:
    """Starts the zygote (from the reference venv) on first use; `stop()` ends it."""

    def __init__(self, python: str, env: dict[str, str]):
        self._dir = tempfile.mkdtemp(prefix="vllm_zygote_")
        self._socket_path = os.path.join(self._dir, "zygote.sock")
        self._log = open(os.path.join(self._dir, "zygote.log"), "wb")
        self._proc = subprocess.Popen(
            [python, "-m", "tests.support.vllm_zygote", self._socket_path],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log,
            env={**env, "PYTHONPATH": str(REPO)}, cwd=REPO, start_new_session=True,
        )  # fmt: skip
        self._ready = threading.Event()
        self._lock = threading.Lock()

    def _wait_ready(self) -> None:
        if not self._ready.is_set():
            with self._lock:
                if not self._ready.is_set():
                    line = self._proc.stdout.readline()
                    if line.strip() != b"ready":
                        raise RuntimeError(f"vLLM zygote failed: {Path(self._log.name).read_text(errors='replace')[-4000:]}")
                    self._ready.set()

    def request(self, message: dict) -> dict:
        self._wait_ready()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(self._socket_path)
            with s.makefile("rw") as stream:
                stream.write(json.dumps(message) + "\n")
                stream.flush()
                return json.loads(stream.readline())

    def start(self, argv: list[str], *, env: dict[str, str], cwd: str | Path, log: str | Path) -> ZygoteChild:
        reply = self.request({"op": "start", "argv": argv, "env": env, "cwd": str(cwd), "log": str(log)})
        return ZygoteChild(self, reply["pid"])

    def stop(self) -> None:
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait(timeout=10)
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)


_shared: ZygoteClient | None = None
_shared_lock = threading.Lock()


def shared_zygote() -> ZygoteClient:
    """This process's zygote, started on first use (its imports then run while the caller goes on) and
    stopped when the process exits."""
    global _shared
    with _shared_lock:
        if _shared is None:
            import atexit

            from .reference_venv import reference_python
            from .vllm_reference import WORKER_IN_ENGINE_CORE, vllm_env

            _shared = ZygoteClient(reference_python(), vllm_env(**WORKER_IN_ENGINE_CORE))
            atexit.register(_shared.stop)
        return _shared


if __name__ == "__main__":
    _serve(sys.argv[1])

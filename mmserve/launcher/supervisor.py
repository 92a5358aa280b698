"""Keeping one `vllm serve --headless` engine process running: start, forward logs, restart, stop.

`EngineSupervisor` runs a command line (from `vllm_serve_argv`) as a child process and
- forwards each line it prints to a logger (the Ray actor's log, so `serve` logs show it);
- restarts it when it exits, after a back-off that doubles up to a cap (reset once a process
  lived long enough), and on request (`restart`: the engine client declared the engine hung, or
  waits on a new handshake address);
- stops it (`stop`): SIGCONT + SIGTERM (vLLM stops its EngineCore children itself), then
  SIGKILL to every process of the tree that is left — the tree is listed from /proc before the
  signals, since orphans are re-parented away from us as soon as their parent dies.

Each process gets a directory of its own for vLLM's IPC socket files (`VLLM_RPC_BASE_PATH`, else /tmp),
removed once the process and its tree are gone: a killed engine leaves its sockets behind, and an
engine restarted for months would fill /tmp with them.

The child stays in our process group (a new session would take vLLM's children out of reach of
whoever cleans up after us) and gets SIGTERM when our process dies (`parent_death.py`), so a
killed launcher does not leave an engine running.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from .parent_death import dies_with_parent

logger = logging.getLogger(__name__)

# Flags the launcher sets itself: the engine must connect to its engine client and nowhere else.
RESERVED_FLAGS = frozenset({"headless", "data-parallel-address", "data-parallel-rpc-port"})


def vllm_serve_argv(command: Sequence[str], model: str, handshake: str, engine_args: Mapping[str, Any]) -> list[str]:
    """`vllm serve MODEL --headless` connecting to `handshake` (tcp://HOST:PORT), with `engine_args`
    as the `vllm serve` flags users know: `{"max-model-len": 1024, "enforce-eager": true,
    "mm-processor-cache-gb": 0}` → `--max-model-len 1024 --enforce-eager --mm-processor-cache-gb 0`
    (False → `--no-FLAG`, a list → the flag followed by each item)."""
    parts = urlsplit(handshake)
    if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
        raise ValueError(f"engine handshake address must be tcp://HOST:PORT, got {handshake!r}")
    argv = [*command, "serve", model, "--headless", "--data-parallel-address", parts.hostname, "--data-parallel-rpc-port", str(parts.port)]
    for key, value in engine_args.items():
        flag = key.removeprefix("--").replace("_", "-")
        if flag in RESERVED_FLAGS:
            raise ValueError(f"engine argument {key!r} is set by the launcher (the engine connects to its engine client)")
        if value is True:
            argv.append(f"--{flag}")
        elif value is False:
            argv.append(f"--no-{flag}")
        elif value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv += [f"--{flag}", *(str(v) for v in value)]
        else:
            argv += [f"--{flag}", str(value)]
    return argv


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants (Linux /proc), root first.

    Read from each process's threads' `children` lists (a few files for an engine's tree), not by
    reading every process's `stat` (a Ray node's hundred processes, twice a second for an engine's
    whole life); the full scan where the kernel has no such lists."""
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:  # gone since its parent listed it
            continue
        for tid in threads:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo.extend(int(child) for child in f.read().split())
            except FileNotFoundError:
                if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                    continue  # the thread ended
                return _process_tree_by_scan(root)  # no `children` lists in this kernel
            except (OSError, ValueError):
                continue
    return tree


def _process_tree_by_scan(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def processes_in_run(run_dir: str) -> list[int]:
    """Every process whose environment names this run's IPC directory: the engine's descendants,
    orphans included (a child started and left behind between two looks at the tree)."""
    marker = f"VLLM_RPC_BASE_PATH={run_dir}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def _signal_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class RestartPolicy:
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    # A process that lived this long resets the back-off (it was not crash-looping).
    stable_after_s: float = 60.0
    # SIGTERM → SIGKILL grace on stop and restart.
    stop_timeout_s: float = 15.0


@dataclass
class EngineSupervisor:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    log: logging.Logger = logger
    starts: int = 0
    exits: list[int | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._restart_now = asyncio.Event()
        self._last_tree: list[int] = []
        self._run_dir: str | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None and self._process.poll() is None else None

    def start(self) -> None:
        """Start the process and keep it running until `stop()` (call from a long-lived event loop
        thread: PR_SET_PDEATHSIG fires when the thread that started the child exits)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-supervisor")

    async def restart(self, reason: str, argv: list[str] | None = None) -> None:
        """Kill the running process now (it is hung, or must connect elsewhere) and start it again
        at once, with `argv` if given."""
        self.log.warning("restarting the engine: %s", reason)
        if argv is not None:
            self.argv = argv
        self._restart_now.set()
        await self._kill_tree(graceful=False)

    async def stop(self) -> None:
        """Stop the process and everything it started; no restart after this."""
        self._stopping = True
        await self._kill_tree(graceful=True)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def kill_now(self, reason: str) -> list[int]:
        """Kill the engine's whole tree at once, with no grace and no restart after it; safe from
        any thread (its loop may be about to go away: the node this runs on was lost, see
        `deployments/raylet_watch.py`). Returns the processes signalled."""
        self._stopping = True
        pids = sorted({*self.tree(), *(processes_in_run(self._run_dir) if self._run_dir else [])})
        self.log.warning("killing the engine now (%d processes): %s", len(pids), reason)
        _signal_all(pids, signal.SIGCONT)
        _signal_all(pids, signal.SIGKILL)
        return pids

    def tree(self) -> list[int]:
        pid = self.pid
        return process_tree(pid) if pid is not None else []

    async def _run(self) -> None:
        backoff = self.policy.backoff_initial_s
        while not self._stopping:
            started = time.monotonic()
            self._restart_now.clear()
            run_dir = self._run_dir = tempfile.mkdtemp(prefix="mmserve-engine-")
            try:
                # A plain Popen, not asyncio's: asyncio's wait() also waits for the output pipe to close,
                # which a child the engine left behind can hold open forever.
                self._process = process = subprocess.Popen(
                    dies_with_parent(self.argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    env={**os.environ, "VLLM_RPC_BASE_PATH": run_dir, **self.env},
                )
                self.starts += 1
                self.log.info("engine process %d started: %s", process.pid, " ".join(self.argv))
                threading.Thread(target=self._forward_output, args=(process,), daemon=True, name="engine-log").start()
                track = asyncio.create_task(self._track_tree(process.pid))
                code = await asyncio.to_thread(process.wait)
                track.cancel()
                # Children the engine left behind when it died (re-parented away from us by now): those
                # the tree showed, and any started since the last look, found by the run's environment.
                _signal_all(sorted({*self._last_tree[1:], *processes_in_run(run_dir)}), signal.SIGKILL)
            finally:  # also when `stop()` cancels this loop, after killing the tree
                shutil.rmtree(run_dir, ignore_errors=True)
            self.exits.append(code)
            if self._stopping:
                return
            lived = time.monotonic() - started
            if self._restart_now.is_set():
                delay = 0.0
            else:
                if lived >= self.policy.stable_after_s:
                    backoff = self.policy.backoff_initial_s
                delay, backoff = backoff, min(backoff * 2, self.policy.backoff_max_s)
                self.log.error("engine process %d exited with code %s after %.0f s; restarting in %.1f s", self._process.pid, code, lived, delay)
            try:
                await asyncio.wait_for(self._restart_now.wait(), delay)
            except TimeoutError:
                pass

    async def _track_tree(self, pid: int) -> None:
        while True:
            self._last_tree = process_tree(pid)
            await asyncio.sleep(0.5)

    def _forward_output(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        with process.stdout:
            for line in process.stdout:
                self.log.info("[engine %d] %s", process.pid, line.decode(errors="replace").rstrip())

    async def _kill_tree(self, *, graceful: bool) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        tree = process_tree(process.pid)
        _signal_all(tree, signal.SIGCONT)  # a stopped (hung) process would sit on SIGTERM forever
        if graceful:
            _signal_all([process.pid], signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.to_thread(process.wait), self.policy.stop_timeout_s)
            except TimeoutError:
                pass
        # Whatever is left of the tree, including children the engine did not stop in time.
        _signal_all(tree, signal.SIGKILL)
        await asyncio.to_thread(process.wait)

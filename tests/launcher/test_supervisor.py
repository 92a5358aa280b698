"""The engine supervisor on real process trees: a parent that prints, starts a grandchild which
ignores SIGTERM (as a stuck vLLM worker might), and exits or hangs on demand. Every test ends by
listing /proc: nothing of any tree it started may be left."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from mmserve.launcher.supervisor import EngineSupervisor, RestartPolicy, process_tree, vllm_serve_argv
from tests.support.processes import pid_gone

FAKE_ENGINE = r"""
import os, signal, socket, subprocess, sys, time, uuid
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
# An IPC socket file where vLLM puts them (get_open_zmq_ipc_path), left behind as vLLM leaves them.
ipc = os.path.join(os.environ["VLLM_RPC_BASE_PATH"], str(uuid.uuid4()))
socket.socket(socket.AF_UNIX).bind(ipc)
print(f"engine up, child {child.pid}, socket file {ipc}", flush=True)
if sys.argv[1] == "exit":
    time.sleep(0.5)
    sys.exit(3)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # exits, leaving its stubborn child behind
while True:
    time.sleep(1)
"""


def _alive(pid: int) -> bool:
    return not pid_gone(pid)


async def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout_s} s")


_STARTED: list[EngineSupervisor] = []


@pytest.fixture(autouse=True)
async def _stop_every_supervisor():
    """A failing test still stops what it started: a fake engine left running keeps its supervisor
    waiting on it in the session loop's default executor, which hangs the whole run at its end."""
    yield
    while _STARTED:
        await _STARTED.pop().stop()


def _supervisor(mode: str, caplog=None, **policy) -> EngineSupervisor:
    log = logging.getLogger("test.engine")
    sup = EngineSupervisor([sys.executable, "-c", FAKE_ENGINE, mode], policy=RestartPolicy(**policy), log=log)
    _STARTED.append(sup)
    return sup


async def test_stop_leaves_no_process_even_a_child_that_ignores_sigterm(caplog):
    caplog.set_level(logging.INFO, "test.engine")
    sup = _supervisor("run", stop_timeout_s=2.0)
    sup.start()
    tree = await _wait(lambda: len(sup.tree()) == 2 and sup.tree(), 20, "engine and child running")
    # The engine's own line (the logged command line holds the words "engine up" too, not a path).
    printed = await _wait(lambda: re.search(r"socket file (/\S+)", caplog.text), 10, "output forwarded to the log")
    assert all(_alive(pid) for pid in tree)
    ipc = Path(printed.group(1))
    assert ipc.exists() and ipc.parent.name.startswith("mmserve-engine-")
    await sup.stop()
    await _wait(lambda: not any(_alive(pid) for pid in tree), 5, "tree gone")
    assert sup.starts == 1
    assert not ipc.parent.exists()  # its IPC sockets' directory went with it


async def test_exit_is_restarted_with_doubling_backoff(caplog):
    caplog.set_level(logging.INFO, "test.engine")
    sup = _supervisor("exit", backoff_initial_s=0.5, backoff_max_s=1.0, stop_timeout_s=2.0)
    sup.start()
    seen: set[int] = set()
    started = time.monotonic()

    def three_starts():
        seen.update(sup.tree())
        return sup.starts >= 3

    await _wait(three_starts, 30, "three starts")
    # Each run lives ≈0.5 s; back-offs 0.5 then 1.0 s before the third start.
    assert time.monotonic() - started >= 2.0
    assert sup.exits[:2] == [3, 3]
    await sup.stop()
    await _wait(lambda: not any(_alive(pid) for pid in seen), 5, "no orphan of any run (the children left by exits included)")
    run_dirs = {Path(path).parent for path in re.findall(r"socket file (/\S+)", caplog.text)}
    assert len(run_dirs) >= 2 and not any(d.exists() for d in run_dirs)  # one per start, each removed


async def test_restart_kills_a_hung_tree_and_starts_at_once():
    sup = _supervisor("run", backoff_initial_s=30, stop_timeout_s=2.0)
    sup.start()
    tree = await _wait(lambda: len(sup.tree()) == 2 and sup.tree(), 20, "running")
    for pid in tree:
        os.kill(pid, signal.SIGSTOP)  # hung: nothing answers, not even SIGTERM
    began = time.monotonic()
    await sup.restart("declared hung by its engine client")
    new_tree = await _wait(lambda: len(sup.tree()) == 2 and sup.tree(), 20, "running again")
    assert time.monotonic() - began < 10  # no 30 s back-off for a requested restart
    assert not set(new_tree) & set(tree)
    await _wait(lambda: not any(_alive(pid) for pid in tree), 5, "hung tree gone")
    await sup.stop()
    await _wait(lambda: not any(_alive(pid) for pid in new_tree), 5, "tree gone")


def test_vllm_serve_argv_passes_engine_args_as_flags():
    argv = vllm_serve_argv(
        ["vllm"], "/models/m", "tcp://10.0.0.5:29550",
        {"max-model-len": 1024, "enforce_eager": True, "mm-processor-cache-gb": 0, "enable-prefix-caching": False,
         "allowed-local-media-path": None, "limit-mm-per-prompt": '{"image": 2}'},
    )
    assert argv == [
        "vllm", "serve", "/models/m", "--headless", "--data-parallel-address", "10.0.0.5", "--data-parallel-rpc-port", "29550",
        "--max-model-len", "1024", "--enforce-eager", "--mm-processor-cache-gb", "0", "--no-enable-prefix-caching",
        "--limit-mm-per-prompt", '{"image": 2}',
    ]
    with pytest.raises(ValueError, match="set by the launcher"):
        vllm_serve_argv(["vllm"], "m", "tcp://127.0.0.1:1", {"data-parallel-rpc-port": 5})
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        vllm_serve_argv(["vllm"], "m", "ipc:///tmp/x", {})


def test_process_tree_lists_descendants():
    assert process_tree(os.getpid())[0] == os.getpid()


# Two children, one with a child of its own started from a second thread that stays alive (the kernel
# lists a child under the thread that started it, and under another thread only once that one ends).
NESTED_TREE = r"""
import subprocess, sys, threading, time
sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
subprocess.Popen(sleeper)
middle = [sys.executable, "-c", "import subprocess, sys, threading, time; "
          "threading.Thread(target=lambda: (subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']), time.sleep(60))).start(); "
          "time.sleep(60)"]
subprocess.Popen(middle)
print("up", flush=True)
time.sleep(60)
"""


def test_process_tree_finds_grandchildren_started_by_other_threads_as_the_full_scan_does():
    import subprocess

    from mmserve.launcher.supervisor import _process_tree_by_scan

    root = subprocess.Popen([sys.executable, "-c", NESTED_TREE], stdout=subprocess.PIPE, text=True)
    try:
        assert root.stdout is not None and root.stdout.readline() == "up\n"
        deadline = time.monotonic() + 10
        while len(_process_tree_by_scan(root.pid)) < 4:
            assert time.monotonic() < deadline, "the grandchild never started"
            time.sleep(0.05)
        tree = process_tree(root.pid)
        assert tree[0] == root.pid and sorted(tree) == sorted(_process_tree_by_scan(root.pid)) and len(tree) == 4
    finally:
        for pid in reversed(_process_tree_by_scan(root.pid)):
            os.kill(pid, signal.SIGKILL)
        root.wait()


async def test_children_the_tree_never_showed_are_killed_when_the_engine_exits(monkeypatch, caplog):
    """A child started and left behind between two looks at the tree (a loaded machine made it so in a
    full run) is found by its run's environment: here the tree never shows any child."""
    import mmserve.launcher.supervisor as supervisor

    async def blind(self, pid):
        self._last_tree = [pid]

    monkeypatch.setattr(supervisor.EngineSupervisor, "_track_tree", blind)
    await test_exit_is_restarted_with_doubling_backoff(caplog)


async def test_kill_now_takes_the_whole_tree_at_once_and_never_restarts(caplog):
    caplog.set_level(logging.INFO, "test.engine")
    sup = _supervisor("run", backoff_initial_s=0.1, stop_timeout_s=30.0)
    sup.start()
    tree = await _wait(lambda: len(sup.tree()) == 2 and sup.tree(), 20, "engine and child running")
    began = time.monotonic()
    killed = sup.kill_now("its node was lost")  # (the child ignores SIGTERM: no grace is waited for)
    assert set(tree) <= set(killed)
    await _wait(lambda: not any(_alive(pid) for pid in tree), 2, "tree gone")
    assert time.monotonic() - began < 2
    await asyncio.sleep(0.5)  # longer than the back-off: a restart would have come by now
    assert sup.starts == 1 and sup.tree() == []
    assert "killing the engine now (2 processes): its node was lost" in caplog.text

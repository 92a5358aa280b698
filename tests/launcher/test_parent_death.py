"""`dies_with_parent`: the child gets SIGTERM when its parent is killed, runs as the very process it
was started as (exec, same pid), and no `preexec_fn` is needed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from mmserve.launcher.parent_death import dies_with_parent
from tests.support.processes import pid_gone

# A parent that starts a sleeping child through `dies_with_parent`, prints the child's pid, then waits
# to be killed.
PARENT = """
import subprocess, sys, time
from mmserve.launcher.parent_death import dies_with_parent
child = subprocess.Popen(dies_with_parent([sys.executable, "-c", "import time; time.sleep(600)"]))
print(child.pid, flush=True)
time.sleep(600)
"""


def test_the_child_is_terminated_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 10
        while "time.sleep(600)" not in open(f"/proc/{child}/cmdline").read().replace("\0", " "):
            assert time.monotonic() < deadline, "the child never became its command"
            time.sleep(0.02)  # the wrapper replaces itself with the command (same pid)
        assert not pid_gone(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 5
        while not pid_gone(child):
            assert time.monotonic() < deadline, "the child outlived its killed parent"
            time.sleep(0.02)
    finally:
        if not pid_gone(child):
            os.kill(child, signal.SIGKILL)


def test_the_command_runs_with_its_environment_and_exit_status():
    argv = dies_with_parent([sys.executable, "-c", "import os, sys; print(os.environ['MMSERVE_TEST_VALUE']); sys.exit(7)"])
    done = subprocess.run(argv, env={**os.environ, "MMSERVE_TEST_VALUE": "kept"}, capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (7, "kept\n")

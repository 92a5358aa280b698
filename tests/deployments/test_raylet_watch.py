"""The raylet watch on real processes: a child whose parent is SIGKILLed notices within its interval."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from deployments.raylet_watch import RayletWatch, _process_name

REPO = Path(__file__).resolve().parents[2]

# The watched process: watches its parent (whatever its name) and reports the loss in a file.
CHILD = r"""
import os, sys, time
sys.path.insert(0, sys.argv[2])
from deployments.raylet_watch import RayletWatch, _process_name
def lost():
    # Written whole, then renamed: the test reads the file as soon as it exists.
    with open(sys.argv[1] + ".part", "w") as f:
        f.write(f"{time.time()} {os.getppid()}")
    os.replace(sys.argv[1] + ".part", sys.argv[1])
    os._exit(0)
started = RayletWatch(lost, interval_s=0.1, parent_name=_process_name(os.getppid())).start()
print("watching" if started else "not started", flush=True)
time.sleep(60)
"""

# Its parent (the raylet's stand-in): starts the child, then waits to be killed.
PARENT = r"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]])
print(child.pid, flush=True)
time.sleep(60)
"""


def test_the_loss_of_the_parent_is_seen_within_the_interval(tmp_path):
    report = tmp_path / "lost"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(report), str(REPO)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "watching"
        assert not report.exists()
        time.sleep(0.5)
        assert not report.exists()  # nothing while the parent lives
        killed_at = time.time()
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while not report.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        seen_at, new_parent = report.read_text().split()
        assert float(seen_at) - killed_at < 0.5
        assert int(new_parent) != parent.pid
    finally:
        parent.kill()
        try:
            os.kill(child_pid, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass


def test_under_a_parent_that_is_not_a_raylet_it_does_not_start():
    assert _process_name(os.getppid()) != "raylet"
    assert RayletWatch(lambda: None).start() is False

"""What a `serve run` stopped other than by Ctrl+C would leave behind: Serve's HAProxy.

Serve's HAProxy manager actor starts HAProxy as its child and stops it when Serve shuts down. Killed instead
(the `serve run` process or its process group sent SIGTERM, SIGKILL, Ray stopped under it), the actor
dies and its HAProxy lives on, an orphan holding Serve's HTTP port and its own metrics and stats ports:
the next `serve run` fails on HAProxy's bind error. So the process that builds the application starts
a reaper in a session of its own (a signal to the group does not reach it): it waits for the process
whose end stops Serve on this node (`watched_process`: `serve run` building an import path, or the
raylet of the worker building a config's applications) and then ends every orphaned Serve HAProxy for
`REAP_WINDOW_S`, the time Ray takes to stop a node's workers. An HAProxy whose actor lives (Serve still running, on a cluster
`serve run` only deployed to) is never touched. And should an orphan hold a port at start-up still
(left by a run from before the reaper), the start-up names it and how to end it.

    python serve_app/leftovers.py PID     # the reaper of `serve run` process PID (run as a file:
                                          # it imports psutil only, not Ray, for its whole life)
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

# Ray's settings for where HAProxy's config lives and which ports it takes besides Serve's HTTP port.
_CONFIG_DIR = Path(os.environ.get("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "/tmp/haproxy-serve/haproxy.cfg")).parent
HTTP_PORT = 8000
HAPROXY_PORTS = (
    int(os.environ.get("RAY_SERVE_HAPROXY_METRICS_PORT", "9101")),
    int(os.environ.get("RAY_SERVE_HAPROXY_STATS_PORT", "8404")),
)

# How long after `serve run` ended orphans are looked for: Ray's raylet stops the HAProxy manager actor, and with
# it orphans HAProxy, some seconds after the driver is gone.
REAP_WINDOW_S = 60.0
_LOOK_EVERY_S = 0.5
# How long a start-up waits for an orphan holding its port to be ended before it names it.
START_UP_WAIT_S = 5.0


def _is_serve_haproxy(process: psutil.Process) -> bool:
    try:
        command = process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    if not command or Path(command[0]).name != "haproxy" or "-f" not in command[:-1]:
        return False
    return Path(command[command.index("-f") + 1]).is_relative_to(_CONFIG_DIR)


def _orphaned(process: psutil.Process) -> bool:
    """Its parent is no Ray worker (Serve's HAProxy manager actor is one: `ray::HAProxyManager`)."""
    try:
        parent = process.parent()
        return parent is None or not parent.cmdline()[:1] or not parent.cmdline()[0].startswith("ray::")
    except (psutil.NoSuchProcess, psutil.AccessDenied, IndexError):
        return True


def orphaned_haproxies() -> list[psutil.Process]:
    """Every Serve HAProxy on this machine whose actor is gone."""
    return [p for p in psutil.process_iter() if _is_serve_haproxy(p) and _orphaned(p)]


def held_ports(process: psutil.Process, ports: Iterable[int]) -> list[int]:
    """Which of `ports` `process` listens on."""
    wanted = set(ports)
    try:
        connections = process.net_connections(kind="inet")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
    return sorted({c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN and c.laddr.port in wanted})


def leftover_message(ports: Iterable[int] = (HTTP_PORT, *HAPROXY_PORTS), wait_s: float = 0.0) -> str | None:
    """One line naming an orphaned Serve HAProxy that holds one of `ports`, and how to end it; None if none
    does, or none still does after `wait_s` (the reaper of a run stopping right now ends its own)."""
    ports = tuple(ports)
    deadline = time.monotonic() + wait_s
    while True:
        held = [(process, ports_held) for process in orphaned_haproxies() if (ports_held := held_ports(process, ports))]
        if not held:
            return None
        if time.monotonic() >= deadline:
            process, ports_held = held[0]
            return (
                f"port {', '.join(map(str, ports_held))} is held by haproxy (pid {process.pid}), left by an earlier "
                f"`serve run` whose Serve was not shut down; end it with `kill {process.pid}` and start again"
            )
        time.sleep(_LOOK_EVERY_S)


def end(processes: Iterable[psutil.Process], grace_s: float = 2.0) -> None:
    """SIGTERM (HAProxy's hard stop), then SIGKILL for any still there after `grace_s`."""
    processes = list(processes)
    for process in processes:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def reap(pid: int, window_s: float = REAP_WINDOW_S) -> None:
    """Wait for process `pid` to end, then end orphaned Serve HAProxies for `window_s`."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        pass
    else:
        select.select([fd], [], [])  # readable once the process has ended; no polling meanwhile
        os.close(fd)
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        if orphans := orphaned_haproxies():
            end(orphans)
        time.sleep(_LOOK_EVERY_S)


def start_reaper(pid: int) -> str | None:
    """The reaper of process `pid`, in a session of its own, no child of this process (Ray ends the
    children of a worker that exits); it exits at once if `pid` has one already. Why it could not be
    started, if it could not (the service runs without it)."""
    started = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--detach", str(pid)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=30,
    )
    if started.returncode != 0:
        return started.stderr.decode(errors="replace").strip().splitlines()[-1:][0] if started.stderr.strip() else f"exit {started.returncode}"
    return None


def watched_process() -> int | None:
    """Whose end leaves orphans behind, for a process that builds the application: the raylet, for a Ray
    worker (a Serve config's applications are built in one); this process, for one that is about to start
    Ray (`serve run` of an import path); None for a driver attached to a running Ray (it stops nothing)."""
    import ray

    if not ray.is_initialized():
        return os.getpid()
    parent = psutil.Process().parent()
    return parent.pid if parent is not None and parent.name() == "raylet" else None


def _main(pid: int) -> None:
    lock = Path(tempfile.gettempdir()) / f"mmserve-haproxy-reaper-{pid}.lock"
    with open(lock, "w") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # (a reaper watches that process already: each rebuild of the application starts one)
        try:
            reap(pid)
        finally:
            lock.unlink(missing_ok=True)


if __name__ == "__main__":
    if sys.argv[1] == "--detach":  # start the reaper and leave it to init
        subprocess.Popen(
            [sys.executable, __file__, sys.argv[2]],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
    else:
        _main(int(sys.argv[1]))

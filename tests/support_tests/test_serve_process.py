"""A `serve run` whose Ray node start timed out is started again, once; any other early exit fails."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.serve_process import RAY_NODE_START_TIMED_OUT, ServeRunProcess
from tests.support.vllm_engines import free_tcp_port


def _command(tmp: Path, port: int, failures: int, message: str) -> str:
    """Exits with `message` the first `failures` times, then serves /health (200) on `port`."""
    (tmp / "site").mkdir(exist_ok=True)
    (tmp / "site" / "health").write_text("ok")
    counter = tmp / "starts"
    return (
        f"n=$(cat {counter} 2>/dev/null || echo 0); echo $((n + 1)) > {counter}; "
        f"if [ $n -lt {failures} ]; then echo '{message}'; exit 1; fi; "
        f"exec {sys.executable} -m http.server {port} --bind 127.0.0.1 -d {tmp / 'site'}"
    )


def test_a_timed_out_ray_start_is_made_again_once(tmp_path: Path) -> None:
    port = free_tcp_port()
    command = _command(tmp_path, port, 1, f"Exception: {RAY_NODE_START_TIMED_OUT}. This could happen ...")
    with ServeRunProcess(command, tmp_path, tmp_path / "serve.log", port, env={"PATH": "/usr/bin:/bin"}).start(30) as serve:
        assert serve.proc is not None and serve.proc.poll() is None
    assert (tmp_path / "starts").read_text().strip() == "2"
    assert RAY_NODE_START_TIMED_OUT in (tmp_path / "serve.log.first-attempt").read_text()


def test_it_is_made_again_only_once(tmp_path: Path) -> None:
    port = free_tcp_port()
    command = _command(tmp_path, port, 2, f"Exception: {RAY_NODE_START_TIMED_OUT}.")
    with pytest.raises(AssertionError, match="exited 1 before serving"):
        ServeRunProcess(command, tmp_path, tmp_path / "serve.log", port, env={"PATH": "/usr/bin:/bin"}).start(30)
    assert (tmp_path / "starts").read_text().strip() == "2"


def test_any_other_early_exit_fails_at_once(tmp_path: Path) -> None:
    port = free_tcp_port()
    command = _command(tmp_path, port, 1, "ImportError: no module named serve_app")
    with pytest.raises(AssertionError, match="no module named serve_app"):
        ServeRunProcess(command, tmp_path, tmp_path / "serve.log", port, env={"PATH": "/usr/bin:/bin"}).start(30)
    assert (tmp_path / "starts").read_text().strip() == "1"

"""`free_tcp_port`: never the same port twice in one process, even while none of them is bound yet."""

from __future__ import annotations

import pytest

from tests.support import vllm_engines


def test_ports_drawn_together_are_distinct(monkeypatch):
    monkeypatch.setattr(vllm_engines, "_QUIET_PORTS", range(31990, 31993))
    monkeypatch.setattr(vllm_engines, "_HANDED_OUT", set())
    drawn = [vllm_engines.free_tcp_port() for _ in range(3)]
    assert sorted(drawn) == [31990, 31991, 31992]
    with pytest.raises(RuntimeError, match="no free port"):
        vllm_engines.free_tcp_port()

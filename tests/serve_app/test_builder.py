"""The application builder: it says so when Ray was started without HAProxy (Serve's Python proxy on the request path)."""

from __future__ import annotations

import logging

import pytest

from serve_app.builder import HA_PROXY_FLAG, build_app


@pytest.mark.parametrize("flag", [None, "1"])
def test_a_missing_ha_proxy_flag_is_warned_about(flag, monkeypatch, caplog):
    if flag is None:
        monkeypatch.delenv(HA_PROXY_FLAG, raising=False)
    else:
        monkeypatch.setenv(HA_PROXY_FLAG, flag)
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        build_app({})
    warned = [r for r in caplog.records if HA_PROXY_FLAG in r.getMessage()]
    assert bool(warned) == (flag is None)

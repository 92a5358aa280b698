"""`engine_launch` configuration: exclusive with `engines`, needs the model, and the engine's
multimodal cache settings come from its own flags; keys of other modes are refused, not ignored."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serve_app.config import AppConfig


def test_launched_engines_get_loopback_endpoints_with_their_cache_flags():
    config = AppConfig.model_validate({
        "model": "/models/m",
        "engine_launch": '{"count": 2, "engine_args": {"mm_processor_cache_gb": 0.5, "--mm-processor-cache-type": "shm"}}',
    })
    endpoints = config.engine_endpoints()
    assert [e.handshake for e in endpoints] == ["tcp://127.0.0.1:0"] * 2
    assert {(e.mm_processor_cache_gb, e.mm_processor_cache_type) for e in endpoints} == {(0.5, "shm")}
    assert not config.uses_builtin_engine
    default = AppConfig.model_validate({"model": "/models/m", "engine_launch": {}}).engine_endpoints()[0]
    assert (default.mm_processor_cache_gb, default.mm_processor_cache_type) == (4.0, "lru")


def test_engine_launch_is_exclusive_with_engines_and_needs_a_model():
    with pytest.raises(ValidationError, match="not both"):
        AppConfig.model_validate({"model": "/m", "engines": ["tcp://127.0.0.1:5"], "engine_launch": {}})
    with pytest.raises(ValidationError, match="needs model"):
        AppConfig.model_validate({"engine_launch": {}})
    with pytest.raises(ValidationError):
        AppConfig.model_validate({"model": "/m", "engine_launch": {"count": 0}})


def test_keys_that_do_nothing_in_a_mode_are_refused():
    with pytest.raises(ValidationError, match="engine_client_resources does nothing with engine_launch"):
        AppConfig.model_validate({"model": "/m", "engine_launch": {}, "engine_client_resources": {"gpu_host": 0.001}})
    with pytest.raises(ValidationError, match="builtin_engine does nothing"):
        AppConfig.model_validate({"model": "/m", "engine_launch": {}, "builtin_engine": {"max_num_seqs": 8}})
    with pytest.raises(ValidationError, match="builtin_engine does nothing"):
        AppConfig.model_validate({"engines": ["tcp://127.0.0.1:5"], "builtin_engine": '{"max_num_seqs": 8}'})
    # Each where it applies.
    AppConfig.model_validate({"engines": ["tcp://127.0.0.1:5"], "engine_client_resources": {"gpu_host": 0.001}})
    AppConfig.model_validate({"builtin_engine": {"max_num_seqs": 8}})

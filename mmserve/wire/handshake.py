"""Startup handshake between a front-end and a `vllm serve --headless` engine.

Mirrors vLLM 0.32's `EngineCoreProc.startup_handshake`/`_perform_handshake` and
`EngineHandshakeMetadata`/`EngineZmqAddresses` (vllm/v1/engine/utils.py), and the
`EngineCoreReadyResponse` the engine sends on each input socket once its model is loaded.
All of these are msgpack maps.

Flow (front-end binds everything, the engine connects):
  engine → handshake ROUTER: HELLO
  front-end → engine:        HandshakeInit (where the input/output sockets are)
  engine → input ROUTER:     ReadyResponse (also teaches the ROUTER the engine's identity)
  engine → handshake ROUTER: READY
"""

from __future__ import annotations

import msgspec


class EngineStatusMessage(msgspec.Struct):
    """The HELLO and READY messages (`{"status", "local", "headless"}`)."""

    status: str
    local: bool = False
    headless: bool = True
    parallel_config_hash: str | None = None


class EngineZmqAddresses(msgspec.Struct):
    """Mirrors `vllm.v1.engine.utils.EngineZmqAddresses`."""

    inputs: list[str]
    outputs: list[str]
    coordinator_input: str | None = None
    coordinator_output: str | None = None
    frontend_stats_publish_address: str | None = None


class HandshakeInit(msgspec.Struct):
    """Mirrors `EngineHandshakeMetadata`: the front-end's reply to HELLO."""

    addresses: EngineZmqAddresses
    parallel_config: dict[str, int | str | list[int]] = {}


class ReadyResponse(msgspec.Struct):
    """Mirrors `vllm.v1.engine.EngineCoreReadyResponse` (fields we read; others ignored)."""

    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    dtype: str
    vllm_version: str
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    data_parallel_rank: int = 0
    data_parallel_size: int = 1
    world_size: int = 1
    instance_id: str = ""
    supports_lora: bool = False
    kv_cache_size_tokens: int | None = None
    enable_sleep_mode: bool = False


def engine_identity(data_parallel_rank: int) -> bytes:
    """The DEALER identity vLLM engines use: their DP rank, 2 bytes little-endian."""
    return data_parallel_rank.to_bytes(2, "little")

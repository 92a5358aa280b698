"""The built-in engine's side of vLLM 0.32's startup handshake, as a headless engine does it.

DEALER (identity = DP rank, 2 bytes LE) → the front-end's handshake ROUTER: HELLO, the init
map with the input/output addresses, then a DEALER to each input address and a PUSH to each
output address, the ready response on the input sockets, READY on the handshake socket.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import msgspec
import zmq

from ..wire.handshake import HandshakeInit, engine_identity
from .settings import BuiltinEngineSettings
from .wire_engine_side import OutputEncoder

logger = logging.getLogger("mmserve.builtin_engine")

VLLM_VERSION = "0.32.0"
HANDSHAKE_TIMEOUT_S = 300.0  # vLLM's HANDSHAKE_TIMEOUT_MINS = 5


def connect(ctx: zmq.Context, kind: int, address: str, identity: bytes | None = None, linger_ms: int = 4000) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    return sock


def handshake(
    ctx: zmq.Context, settings: BuiltinEngineSettings, ready: dict[str, Any], stop: threading.Event
) -> tuple[list[zmq.Socket], list[zmq.Socket]] | None:
    """(input sockets, output sockets) once READY was sent; None if `stop` was set first."""
    identity = engine_identity(settings.dp_rank)
    hs = connect(ctx, zmq.DEALER, settings.handshake_address, identity, linger_ms=5000)
    try:
        hs.send(msgspec.msgpack.encode({"status": "HELLO", "local": False, "headless": True}))
        logger.info("said HELLO to %s; waiting for the front-end", settings.handshake_address)
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        while not hs.poll(100):
            if stop.is_set():
                logger.info("shutdown requested before the handshake completed")
                return None
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Did not receive response from front-end process within {HANDSHAKE_TIMEOUT_S / 60:.0f} minutes"
                )
        init = msgspec.msgpack.decode(hs.recv(), type=HandshakeInit)
        addresses = init.addresses
        if not addresses.inputs or not addresses.outputs:
            raise RuntimeError(f"handshake init without input/output addresses: {addresses}")
        inputs = [connect(ctx, zmq.DEALER, a, identity) for a in addresses.inputs]
        outputs = [connect(ctx, zmq.PUSH, a) for a in addresses.outputs]
        ready_bytes = OutputEncoder().encode_map(ready)
        for sock in inputs:
            # Teaches the front-end ROUTER our identity.
            sock.send(ready_bytes)
        hs.send(msgspec.msgpack.encode({"status": "READY", "local": False, "headless": True}))
        logger.info("READY: inputs=%s outputs=%s", addresses.inputs, addresses.outputs)
        return inputs, outputs
    finally:
        hs.close()


def ready_response(settings: BuiltinEngineSettings, num_gpu_blocks: int, instance_id: str) -> dict[str, Any]:
    """vLLM 0.32's EngineCoreReadyResponse for this engine."""
    c = settings
    kv_tokens = num_gpu_blocks * c.block_size
    return {
        "max_model_len": c.max_model_len,
        "num_gpu_blocks": num_gpu_blocks,
        "block_size": c.block_size,
        "dp_stats_address": None,
        "dtype": "bfloat16",
        "vllm_version": VLLM_VERSION,
        "world_size": 1,
        "data_parallel_size": 1,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "decode_context_parallel_size": 1,
        "data_parallel_rank": c.dp_rank,
        "max_num_seqs": c.max_num_seqs,
        "max_num_batched_tokens": max(c.max_model_len, 8192),
        "instance_id": instance_id,
        "supports_lora": False,
        "max_loras": 0,
        "mamba_block_size": None,
        "kv_cache_size_tokens": kv_tokens,
        "kv_cache_max_concurrency": kv_tokens / c.max_model_len,
        "kv_events_config": None,
        "weight_transfer_backend": None,
        "enable_sleep_mode": False,
    }

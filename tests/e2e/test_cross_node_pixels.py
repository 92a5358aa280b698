"""The pixels across nodes (`cross_node_scenario.py`, in a process of its own): on a two-node `ray start`
cluster, the preprocessor on the head and the engine client beside its real vLLM engine on the other
node, image chats are answered with the tokens `vllm serve` gives for them, and their pixels reach the
engine's socket through Ray's object transfer: mapped from the engine node's own object store, into
which Ray copied them from the head's, where the preprocessor wrote them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.ray_start_pool_scenario import run_scenario

pytestmark = pytest.mark.serve

SCENARIO = Path(__file__).with_name("cross_node_scenario.py")


@pytest.mark.real_engine
def test_image_chats_across_nodes_equal_vllm_serve_their_pixels_moved_by_ray(tiny_qwen2_vl_dir):
    result = run_scenario(SCENARIO, tiny_qwen2_vl_dir, "mmxn")
    print(f"cross-node pixels: {json.dumps({k: v for k, v in result.items() if k not in ('mmserve', 'vllm_serve')})}")
    assert result["mmserve"] == result["vllm_serve"] and all(result["mmserve"])
    # The preprocessor on the head, the engine client on the engine node: two object stores.
    assert result["engine_client_node"] == result["engine_node"]
    assert result["preprocessor_nodes"] and result["engine_node"] not in result["preprocessor_nodes"]
    assert result["engine_client_plasma"] and result["preprocessor_plasma"]
    assert result["engine_client_plasma"] != result["preprocessor_plasma"]
    # Each image's pixels went to the engine's socket uncopied from the engine node's store ...
    pixel_frames = [frame for frame in result["frames"] if frame[0] >= 64 * 1024]
    assert len(pixel_frames) == 4, result["frames"]
    assert all(path == result["engine_client_plasma"] and zero_copy for _, path, zero_copy in pixel_frames), pixel_frames
    # ... where Ray's object transfer had put them (a copy created there for each; the engine node
    # writes nothing of its own to its store).
    before, after = result["engine_node_created_bytes"]
    assert after - before >= sum(nbytes for nbytes, _, _ in pixel_frames), (before, after, pixel_frames)

"""vLLM's own API server, started with no engine of its own, served by the built-in engine run as its own
process: the stand-in `bench/capacity_bench.py` drives both front ends with.

`vllm serve MODEL --data-parallel-size-local 0 --data-parallel-address H --data-parallel-rpc-port P`
waits for a headless engine at H:P; `python -m mmserve.builtin_engine --handshake tcp://H:P` is one. With
one and with two API server processes (`--api-server-count 2`: two input and two output sockets, each
request's outputs sent back to the process that sent it): text, streamed and image chats answered in
full, eight at once.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.defaults import builtin_engine_argv
from tests.support.quick_start import png_data_uri
from tests.support.vllm_engines import VllmApiServer, free_tcp_port

pytestmark = pytest.mark.real_engine

MODEL_NAME = "tiny-qwen2-vl"
MAX_MODEL_LEN = 1024


def _chat(base_url: str, content, **fields) -> dict:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 12, "ignore_eos": True, **fields}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("api_servers", [1, 2])
def test_vllm_api_server_is_served_by_the_builtin_engine(tiny_qwen2_vl_dir, api_servers, tmp_path):
    port = free_tcp_port()
    stand_in = subprocess.Popen(builtin_engine_argv(f"tcp://127.0.0.1:{port}", model_dir=tiny_qwen2_vl_dir, max_model_len=MAX_MODEL_LEN))
    server = VllmApiServer(
        tiny_qwen2_vl_dir, served_model_name=MODEL_NAME, max_model_len=MAX_MODEL_LEN, log_path=tmp_path / "vllm.log",
        extra_args=["--data-parallel-size-local", "0", "--data-parallel-address", "127.0.0.1",
                    "--data-parallel-rpc-port", str(port), "--api-server-count", str(api_servers)],
    ).start()
    try:
        server.wait_healthy(600)
        text = _chat(server.base_url, "Hello!")
        assert text["usage"]["completion_tokens"] == 12 and text["choices"][0]["message"]["content"]

        with httpx.stream("POST", server.base_url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 12, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
        }) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]" and '"completion_tokens":12' in lines[-2]

        image = _chat(server.base_url, [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": png_data_uri()}}])
        # The proof line the built-in engine writes for each image it received with the request.
        assert image["choices"][0]["message"]["content"].startswith("[image 1: grid")
        assert image["usage"]["prompt_tokens"] > text["usage"]["prompt_tokens"]

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: _chat(server.base_url, f"Request {i}."), range(8)))
        assert all(a["usage"]["completion_tokens"] == 12 for a in answers)
        assert stand_in.poll() is None
    except BaseException:
        print(server.log_tail())
        raise
    finally:
        server.stop()
        stand_in.terminate()
        stand_in.wait(20)

"""vLLM's own load tool, `vllm bench serve --backend openai-chat`, runs against the gateway unchanged:
text prompts and random images (its `random-mm` dataset: JPEG data URIs), every request answered.

It runs from the reference venv as users run it (`vllm bench serve` is vLLM's CLI), against the
suite's built-in-engine app; its saved result says how many requests completed and failed."""

from __future__ import annotations

import json
import subprocess

import pytest

from serve_app.config import BUILTIN_MODEL_DIR
from tests.support.reference_venv import reference_python

pytestmark = pytest.mark.serve

PROMPTS = 12


@pytest.mark.parametrize("dataset", [
    ["--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8"],
    # One 256×256 image a request (vLLM's own random-mm dataset sends them as JPEG data URIs).
    ["--dataset-name", "random-mm", "--random-input-len", "16", "--random-output-len", "4",
     "--random-mm-base-items-per-request", "1", "--random-mm-num-mm-items-range-ratio", "0",
     "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}', "--random-mm-bucket-config", "{(256, 256, 1): 1.0}"],
], ids=["text", "images"])
def test_vllm_bench_serve_openai_chat_completes_every_request(builtin_app, tmp_path, dataset):
    command = [
        reference_python(), "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai-chat",
        "--base-url", builtin_app.base_url, "--endpoint", "/v1/chat/completions", "--model", "mmserve-builtin",
        "--tokenizer", str(BUILTIN_MODEL_DIR), *dataset, "--num-prompts", str(PROMPTS), "--max-concurrency", "4",
        "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json",
    ]
    images_before = builtin_app.engine_info().image_requests_received
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env={"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == PROMPTS and result.get("failed", 0) == 0, {k: result.get(k) for k in ("completed", "failed", "errors")}
    assert result["total_output_tokens"] > 0
    images = builtin_app.engine_info().image_requests_received - images_before
    # (vLLM's tool first sends one request of its own to check the server is up.)
    assert images in ((PROMPTS, PROMPTS + 1) if "random-mm" in dataset else (0,)), images

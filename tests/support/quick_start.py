"""README's quick start, run literally once per test session, in a fresh clone and venv.

The commands are read from README.md (the first ```bash block under "## Quick start", one command a
line, each at most `MAX_COMMAND_CHARS`) and run in order with bash (`set -e`) in a fresh `git clone` of
this repository's HEAD (commit first when running it by hand); the last one serves. While it
serves, README's own examples run as pasted (its `curl` with bash, its python with the venv's python),
then the `openai` client asks for `/v1/models`, a text chat, a streamed chat, an image chat (PNG data
URI) and ten constrained chats, and the resize path the service reports is read; then it is stopped. What it gave is kept in
a `QuickStart`, and its venv (a user's install, made by README's command) is shared by the tests that
need a fresh install: `tests/test_quickstart.py` and `tests/deployments/test_fastapi_versions.py`.

Quick start serves on Ray Serve's default port 8000 (it is part of the command a user copies), so
it needs that port free; it says so plainly if it is not.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import re
import shutil
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from tests.support.serve_process import REPO, ServeRunProcess, run_logged

QUICK_START_PORT = 8000
# What a reader takes in at a glance (and a terminal shows on one line).
MAX_COMMAND_CHARS = 120


@dataclass(frozen=True)
class QuickStart:
    clone: Path  # the fresh clone README's commands ran in
    commands: list[str]  # README's quick start commands, as written (the last one serves)
    model: str  # the model id /v1/models named
    resize_reports: tuple[set[str], str, set[str]]  # see resize_path_reports
    reapers: list[str]  # the reapers of HAProxy left behind (serve_app/leftovers.py) running while it served
    reaper_warnings: list[str]  # the start-up's lines saying it runs without one

    @property
    def bin_dir(self) -> Path:
        return self.clone / ".venv" / "bin"


def _quick_start_section(readme: str) -> str:
    return readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]


def readme_quick_start_commands(readme: str) -> list[str]:
    section = _quick_start_section(readme)
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README's quick start has no ```bash block"
    lines = [l for l in block.group(1).strip().splitlines() if l.strip()]
    assert lines and "serve run" in lines[-1], f"README's quick start must end with the command that serves: {lines}"
    assert all(len(l) <= MAX_COMMAND_CHARS for l in lines), [l for l in lines if len(l) > MAX_COMMAND_CHARS]
    return lines


def readme_try_it(readme: str) -> tuple[str, str, str]:
    """The quick start's examples a reader pastes once it serves: (the curl example, the openai client's
    install, the python example)."""
    section = _quick_start_section(readme)
    shell = re.findall(r"```bash\n(.*?)```", section, re.S)
    python = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(shell) == 3 and len(python) == 1, "README's quick start: the commands, curl, the client's install, python"
    return shell[1], shell[2], python[0]


def run_readme_examples(clone: Path, tmp: Path) -> None:
    """README's curl and python examples, pasted as a reader would, against the quick start's service."""
    curl_example, client_install, python = readme_try_it((clone / "README.md").read_text())
    curl = run_logged(["bash", "-ec", curl_example], cwd=clone, timeout_s=120).stdout
    assert json.loads(curl)["choices"][0]["message"]["content"], curl
    run_logged(["bash", "-ec", client_install], cwd=clone, timeout_s=600)
    script = tmp / "readme_example.py"
    script.write_text(python)
    printed = run_logged([str(clone / ".venv" / "bin" / "python"), str(script)], cwd=clone, timeout_s=300).stdout
    # Four answers: a text chat, a streamed one, an image chat, then the JSON-schema answer parsed.
    lines = printed.strip().splitlines()
    [image] = [line for line in lines if " prompt tokens: " in line]
    assert len(lines) >= 4 and lines.index(image) >= 2 and lines[0].strip(), printed
    assert int(image.split()[0]) > 20, printed  # the image's tokens are in the prompt
    assert isinstance(ast.literal_eval(lines[-1])["name"], str), printed


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
    from PIL import Image

    pixels = np.random.default_rng(7).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def exercise_with_openai(base_url: str) -> str:
    """Models, a text chat, a streamed chat and an image chat, each a 200; returns the model id."""
    import openai

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
    constrained_chats_follow_their_constraints(client, model)
    return model


# What people try on the quick start: constrained answers, each checked against its constraint.
_PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
CONSTRAINED = [
    ("response_format json_schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": _PERSON}}},
     lambda t: isinstance(json.loads(t)["name"], str) and isinstance(json.loads(t)["age"], int)),
    ("response_format json_object", {"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ("regex", {"extra_body": {"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ("choice", {"extra_body": {"structured_outputs": {"choice": ["positive", "negative", "neutral"]}}},
     lambda t: t in ("positive", "negative", "neutral")),
    ("grammar", {"extra_body": {"structured_outputs": {"grammar": 'root ::= "SELECT " col " FROM t"\ncol ::= "a" | "b" | "*"'}}},
     lambda t: re.fullmatch(r"SELECT (a|b|\*) FROM t", t)),
]


def constrained_chats_follow_their_constraints(client, model: str) -> None:
    """Each constraint streamed and not (ten requests): the answer follows it."""
    for name, fields, valid in CONSTRAINED:
        for stream in (False, True):
            messages = [{"role": "user", "content": f"Answer as asked ({name})."}]
            if stream:
                chunks = client.chat.completions.create(model=model, messages=messages, stream=True, **fields)
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                text = client.chat.completions.create(model=model, messages=messages, **fields).choices[0].message.content
            assert valid(text), (name, stream, text)


def resize_path_reports(serve: ServeRunProcess) -> tuple[set[str], str, set[str]]:
    """(paths named in the start-up log, path on the model card, paths the /metrics info gauge sets to 1)."""
    import httpx

    card = httpx.get(serve.base_url + "/v1/models", timeout=30).json()["data"][0]
    metrics = httpx.get(serve.base_url + "/metrics", timeout=30).text
    logged = set(re.findall(r"image resize path: ([a-z-]+)", serve.log_text()))
    gauged = set(re.findall(r'^mmserve_image_resize_path_info\{path="([^"]+)"\} 1\.0$', metrics, re.M))
    return logged, card["mmserve"]["image_resize"], gauged


def run_quick_start(tmp: Path) -> QuickStart:
    """Clone, run README's command until it serves, exercise it, stop it."""
    commands = readme_quick_start_commands((REPO / "README.md").read_text())
    clone = tmp / "clone"
    run_logged(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], timeout_s=300)
    assert not (clone / ".venv").exists()
    wait_for_free_port(QUICK_START_PORT)
    script = "\n".join(["set -e", *commands])
    with ServeRunProcess(script, clone, tmp / "quickstart.log", QUICK_START_PORT).start(ready_timeout_s=1500) as serve:
        run_readme_examples(clone, tmp)
        model = exercise_with_openai(serve.base_url)
        reports = resize_path_reports(serve)
        reapers = [" ".join(p.cmdline()) for p in psutil.process_iter() if _is_reaper(p, clone)]
        reaper_warnings = [line for line in serve.log_text().splitlines() if "no reaper" in line]
    return QuickStart(clone=clone, commands=commands, model=model, resize_reports=reports, reapers=reapers,
                      reaper_warnings=reaper_warnings)


def _is_reaper(process: psutil.Process, clone: Path) -> bool:
    try:
        return str(clone / "serve_app" / "leftovers.py") in process.cmdline()
    except psutil.Error:
        return False


class BackgroundQuickStart:
    """`run_quick_start` in a thread of its own, started at once: ``result()`` waits for it."""

    def __init__(self, tmp: Path):
        self._tmp = tmp
        self._result: Future[QuickStart] = Future()
        self._thread = threading.Thread(target=self._run, args=(tmp,), name="quick-start", daemon=True)
        self._thread.start()

    def _run(self, tmp: Path) -> None:
        try:
            self._result.set_result(run_quick_start(tmp))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the result
            self._result.set_exception(exc)

    def result(self) -> QuickStart:
        return self._result.result(timeout=1800)

    def wait(self) -> None:
        self._thread.join(timeout=1800)

    def close(self) -> None:
        """Once it has stopped, remove the clone and its venv (≈1 GB)."""
        self.wait()
        shutil.rmtree(self._tmp, ignore_errors=True)

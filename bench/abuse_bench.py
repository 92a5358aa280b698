"""Abusive clients against the gateway, side by side with vLLM's own server (issue 8's proof).

    .venv/bin/python bench/abuse_bench.py [--repeats 2] [--per-kind 20] [--text-prompts 10] [--scale 1.0]

Two setups on the same tiny random Qwen2-VL (`tests/support/tiny_models.py`) and the same engine
flags as the tests (`tests/support/vllm_engines.py`), one after the other, never at the same time:

- **mmserve**: `serve run` (this worktree's `.venv`, shipped default limits) in its own process
  group and on its own Ray instance (`RAY_TMPDIR` of its own), a `vllm serve --headless` CPU
  engine attached;
- **vLLM**: `vllm serve` (its OpenAI API server; the engine core is its child process).

Per repeat, on the running setup:

1. unloaded probe: small chats (`max_tokens` 4), one at a time with 0.2 s pauses, for
   `--unloaded-s`; its p50 is the reference;
2. 100 slow connections opened and held for the whole abuse: 50 trickle their headers (one
   header line every 2 s), 50 declare a 1 MB text chat and trickle its body (100 bytes a second);
3. the abusive bodies, ≈30 MB each (generated once), 5 at a time, kinds interleaved:
   a data-URI image (random base64), stop strings (100 characters each), many tiny messages,
   malformed JSON (valid until its last bytes), and text prompts (chat and completions); and,
   among them, honest requests that cost the preprocessor most: one distinct 49 MP image each
   (a few MB as PNG, within every default limit);
4. `--settle-s` (60 s) of settling. The probe runs from step 2 to the end of step 4; a probe that does not get
   a 200 within 60 s is lost.

Reported per repeat: probe p50/p95/lost (loaded vs unloaded), each abusive kind's status codes
and time to answer (a raw-socket client: it stops sending once an answer arrives), whether each
answer is a 4xx/503 in OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`,
`Retry-After` on 503), slow connections the server closed, and the RSS (psutil, every 100 ms) of
the gateway's processes — mmserve: the Ingress replica, the Serve proxy and the engine-client
replica; vLLM: its API server process (and the EngineCore, for information) — at baseline (before
step 2), peak (steps 2–4) and at the end of step 4 (a minute after the last abusive answer). mmserve
runs as README starts it (`RAY_SERVE_ENABLE_HA_PROXY=1`: HAProxy in front of the Ingress replicas'
own HTTP servers; the Serve proxy actor stays, idle); its Preprocessor replica and HAProxy are
measured too.

Writes bench/results/abuse.md (tables, medians over repeats) and bench/results/abuse.json (every
number). Not a test: nothing is asserted. The client shares the machine's 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import random
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import psutil  # noqa: E402

from tests.support.serve_process import ServeRunProcess, serve_env  # noqa: E402
from tests.support.vllm_engines import HeadlessVllmEngine, VllmApiServer, free_tcp_port  # noqa: E402

MODEL_NAME = "tiny-qwen2-vl"
MAX_MODEL_LEN = 1024
MB = 1_000_000
HOST = "127.0.0.1"
PROBE_BODY = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
PROBE_TIMEOUT_S = 60.0
PROBE_PAUSE_S = 0.2
SEND_CHUNK = 256 * 1024
CONCURRENCY = 5
SLOW_HEADERS = 50
SLOW_BODIES = 50
SLOW_BODY_DECLARED = 1 * MB
OBSERVATIONS_MARKER = "<!-- observations: hand-written below this line; kept when the script rewrites the file -->"


# ----------------------------------------------------------------------------- bodies


def _words(rng: random.Random, n_bytes: int) -> str:
    vocab = ["lorem", "ipsum", "dolor", "sit", "amet", "gateway", "engine", "token", "abuse", "42", "é", "naïve", "数据"]
    out, size = [], 0
    while size < n_bytes:
        w = rng.choice(vocab)
        out.append(w)
        size += len(w.encode()) + 1
    return " ".join(out)


def make_bodies(size: int) -> dict[str, tuple[str, bytes]]:
    """kind -> (route, body), each body ≈ `size` bytes."""
    rng = random.Random(0)
    chat = "/v1/chat/completions"

    def dump(obj: dict) -> bytes:
        return json.dumps(obj, ensure_ascii=False).encode()

    b64 = base64.b64encode(rng.randbytes(size * 3 // 4)).decode()
    image = dump({"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is in this image?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}}]}]})
    n_stop = size // 104
    stop = dump({"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                 "stop": [f"{i:08d}" + "x" * 92 for i in range(n_stop)]})
    message = {"role": "user", "content": "hi"}
    n_messages = size // len(json.dumps(message).encode() + b", ")
    messages = dump({"model": MODEL_NAME, "max_tokens": 4, "messages": [message] * n_messages})
    # Valid JSON until its last bytes: a parser must read all of it before it can refuse it.
    malformed = messages[: len(messages) - 2] + b', {"role": "user", "content": '
    text = _words(rng, size)
    return {
        "image (data URI)": (chat, image),
        "stop strings": (chat, stop),
        "many messages": (chat, messages),
        "malformed JSON": (chat, malformed),
        "text prompt (chat)": (chat, dump({"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": text}]})),
        "text prompt (completions)": ("/v1/completions", dump({"model": MODEL_NAME, "max_tokens": 4, "prompt": text})),
    }


# Honest requests that cost the preprocessor the most memory the defaults allow: one image of
# just under images.max_image_pixels (50 MP), a few MB as PNG. Each is distinct (the processed-image
# cache would otherwise skip the decode). Served or refused (too many tokens for the tiny model's
# context, or 503 while the preprocessor's pixel budget is full): either way after the decode.
LARGE_IMAGE = "large image (49 MP)"
LARGE_IMAGE_SIDE = 7000


def large_image_bodies(n: int) -> list[bytes]:
    import io

    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:LARGE_IMAGE_SIDE, 0:LARGE_IMAGE_SIDE].astype(np.uint16)
    base = np.stack([x % 256, y % 256, (x // 28 + y // 28) % 256], axis=-1).astype(np.uint8)
    del x, y
    bodies = []
    for i in range(n):
        base[0, :64] = i  # distinct encoded bytes per request
        buf = io.BytesIO()
        Image.fromarray(base).save(buf, "PNG", compress_level=1)
        uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        bodies.append(json.dumps({"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is in this image?"}, {"type": "image_url", "image_url": {"url": uri}}]}]}).encode())
    return bodies


def abuse_schedule(per_kind: int, text_prompts: int) -> list[str]:
    """Kinds interleaved: every kind is in flight throughout, not one after the other."""
    kinds = ["image (data URI)", "stop strings", "many messages", "malformed JSON", LARGE_IMAGE]
    queue = [k for _ in range(per_kind) for k in kinds]
    texts = ["text prompt (chat)", "text prompt (completions)"] * ((text_prompts + 1) // 2)
    step = max(1, len(queue) // max(1, text_prompts))
    for i, kind in enumerate(texts[:text_prompts]):
        queue.insert(min(len(queue), (i + 1) * step + i), kind)
    return queue


# ----------------------------------------------------------------------------- raw HTTP client


@dataclass
class Answer:
    kind: str
    status: int | None  # None: no answer (see `failure`)
    seconds: float
    bytes_sent: int
    failure: str | None = None
    openai_shape: bool = False
    retry_after: bool = False
    message: str = ""


def _is_openai_error(payload: bytes) -> tuple[bool, str]:
    try:
        error = json.loads(payload)["error"]
        ok = isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error) and bool(error["message"])
        return ok, str(error.get("message", ""))[:160]
    except (ValueError, KeyError, TypeError):
        return False, payload[:160].decode(errors="replace")


async def send_abusive(port: int, kind: str, route: str, body: bytes, timeout_s: float) -> Answer:
    """POST `body`; stop sending as soon as an answer arrives (as a real client's library does).

    A raw non-blocking socket: a failed send (the server answered early and closed) must not hide
    an answer already received, as it would with asyncio's streams. A server that closes with
    unread bytes makes the kernel send a reset, which may discard the answer: that is "no answer".
    """
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    sent = 0
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, (HOST, port))
    except OSError as exc:
        sock.close()
        return Answer(kind, None, time.monotonic() - t0, 0, f"connect: {type(exc).__name__}")

    async def send() -> None:
        nonlocal sent
        await loop.sock_sendall(sock, f"POST {route} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
                                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
        view = memoryview(body)
        for i in range(0, len(body), SEND_CHUNK):
            await loop.sock_sendall(sock, view[i:i + SEND_CHUNK])
            sent = min(len(body), i + SEND_CHUNK)

    async def receive() -> bytes:
        data = bytearray()
        try:
            while chunk := await loop.sock_recv(sock, 65536):
                data += chunk
                if _complete(data):
                    break
        except ConnectionError:
            pass  # a reset after (part of) the answer: judged by what arrived
        return bytes(data)

    sender = asyncio.create_task(send())
    try:
        raw = await asyncio.wait_for(receive(), timeout_s)
    except asyncio.TimeoutError:
        return Answer(kind, None, time.monotonic() - t0, sent, f"no answer in {timeout_s:.0f} s")
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        sock.close()
    seconds = time.monotonic() - t0
    parsed = _parse_response(raw)
    if parsed is None:
        return Answer(kind, None, seconds, sent, "connection closed/reset without an answer" if not raw else "incomplete answer")
    status, headers, payload = parsed
    shape, message = _is_openai_error(payload)
    return Answer(kind, status, seconds, sent, None, shape, "retry-after" in headers, message)


def _parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes] | None:
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ", 2)[1])
    except (IndexError, ValueError):
        return None
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        n = int(headers["content-length"])
        return (status, headers, rest[:n]) if len(rest) >= n else None
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts, pos = [], 0
        while True:
            eol = rest.find(b"\r\n", pos)
            if eol == -1:
                return None
            size = int(rest[pos:eol].split(b";")[0], 16)
            if size == 0:
                return status, headers, b"".join(parts)
            parts.append(rest[eol + 2:eol + 2 + size])
            pos = eol + 2 + size + 2
    return status, headers, rest


def _complete(data: bytearray) -> bool:
    head, sep, rest = bytes(data).partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.decode("latin-1").split("\r\n")[1:]:
        k, _, v = line.partition(":")
        if k.strip().lower() == "content-length":
            return len(rest) >= int(v.strip())
    return rest.endswith(b"0\r\n\r\n")


# ----------------------------------------------------------------------------- slow connections


@dataclass
class SlowStats:
    opened: int = 0
    closed_by_server: int = 0
    answered: dict[int, int] = field(default_factory=dict)


async def slow_connection(port: int, body: bool, stop: asyncio.Event, stats: SlowStats, i: int) -> None:
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
    except OSError:
        return
    stats.opened += 1
    if body:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {SLOW_BODY_DECLARED}\r\n\r\n".encode()
                     + json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": ""}]}).encode()[:-4])
    else:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\n".encode())
    read = asyncio.create_task(reader.read(65536))
    n = 0
    try:
        while not stop.is_set():
            done, _ = await asyncio.wait({read, asyncio.create_task(stop.wait())}, timeout=1.0 if body else 2.0,
                                         return_when=asyncio.FIRST_COMPLETED)
            if read in done:
                data = read.result() if not read.exception() else b""
                if data.startswith(b"HTTP/1."):
                    code = int(data.split(b" ", 2)[1])
                    stats.answered[code] = stats.answered.get(code, 0) + 1
                stats.closed_by_server += 1
                return
            n += 1
            writer.write(b"a" * 100 if body else f"X-Slow-{i}-{n}: a\r\n".encode())
            try:
                await writer.drain()
            except ConnectionError:
                stats.closed_by_server += 1
                return
    finally:
        read.cancel()
        writer.close()


# ----------------------------------------------------------------------------- probe and RSS


class Probe(threading.Thread):
    """Small chats, one at a time, in a thread of its own (the abuse's event loop never delays it)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.stop_event = threading.Event()
        self.results: list[tuple[float, float, int | str]] = []  # (start, seconds, status or error)

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=PROBE_TIMEOUT_S) as client:
            while not self.stop_event.is_set():
                t0 = time.monotonic()
                try:
                    outcome: int | str = client.post("/v1/chat/completions", json=PROBE_BODY).status_code
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                self.results.append((t0, time.monotonic() - t0, outcome))
                self.stop_event.wait(PROBE_PAUSE_S)

    def stop(self) -> None:
        self.stop_event.set()
        self.join()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


class RssSampler(threading.Thread):
    def __init__(self, procs: dict[str, psutil.Process], interval_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.procs, self.interval_s = procs, interval_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            row = {}
            for label, proc in self.procs.items():
                try:
                    row[label] = proc.memory_info().rss
                except psutil.Error:
                    pass
            self.samples.append((time.monotonic(), row))
            self.stop_event.wait(self.interval_s)

    def window(self, t0: float, t1: float) -> list[dict[str, int]]:
        return [row for t, row in self.samples if t0 <= t <= t1]


# ----------------------------------------------------------------------------- setups


# vllm runs from the reference venv (tests/support/reference_venv.py); this script from the gateway venv.
if not (REPO / ".venv-ref" / "bin" / "python").exists():
    os.environ.setdefault("MMSERVE_REFERENCE_PYTHON", "/work/venvs/ref/bin/python")


class MmserveSetup:
    name = "mmserve"

    def __init__(self, model_dir: Path, work: Path, extra_env: dict[str, str] | None = None) -> None:
        self.model_dir, self.work, self.extra_env = model_dir, work, extra_env or {}
        if self.extra_env:
            self.name = "mmserve " + " ".join(f"{k}={v}" for k, v in self.extra_env.items())

    def start(self) -> str:
        handshake = free_tcp_port()
        self.engine = HeadlessVllmEngine(self.model_dir, handshake, max_model_len=MAX_MODEL_LEN,
                                         log_path=self.work / "engine.log", as_users_run=True).start()
        port = free_tcp_port()
        args = {"model": str(self.model_dir), "served_model_name": MODEL_NAME,
                "engines": [f"tcp://127.0.0.1:{handshake}"], "handshake_timeout_s": 600, "health_check_timeout_s": 20}
        config = self.work / "serve.yaml"
        config.write_text(json.dumps({
            "http_options": {"host": HOST, "port": port},
            "applications": [{"name": "abuse", "route_prefix": "/", "import_path": "serve_app:build_app", "args": args}],
        }))
        ray_tmp = Path(tempfile.mkdtemp(prefix="ab8b_", dir="/tmp"))  # short: Ray's socket paths must fit
        env = serve_env() | {"RAY_TMPDIR": str(ray_tmp)} | self.extra_env
        self.serve = ServeRunProcess(f"{REPO / '.venv' / 'bin' / 'serve'} run {config}", REPO, self.work / "serve.log", port, env)
        self.serve.start(ready_timeout_s=900)
        return self.serve.base_url

    def processes(self) -> dict[str, psutil.Process]:
        found: dict[str, psutil.Process] = {}
        for proc in psutil.Process(self.serve.proc.pid).children(recursive=True):
            try:
                title = " ".join(proc.cmdline())
            except psutil.Error:
                continue
            if "ServeReplica:" in title and title.rstrip().endswith(":Ingress"):
                found["Ingress replica"] = proc
            elif "ProxyActor" in title:
                found["Serve proxy"] = proc
            elif "ServeReplica:" in title and ":EngineClient" in title:
                found["engine-client replica"] = proc
            elif "ServeReplica:" in title and title.rstrip().endswith(":Preprocessor"):
                found["Preprocessor replica"] = proc
            elif proc.name() == "haproxy":
                found["HAProxy"] = proc
        missing = {"Ingress replica", "Serve proxy", "engine-client replica"} - set(found)
        if missing:
            raise RuntimeError(f"processes not found under serve run: {missing}")
        return found

    def stop(self) -> None:
        self.serve.stop()
        self.engine.stop()


class VllmSetup:
    name = "vLLM serve"

    def __init__(self, model_dir: Path, work: Path) -> None:
        self.model_dir, self.work = model_dir, work

    def start(self) -> str:
        self.server = VllmApiServer(self.model_dir, served_model_name=MODEL_NAME, max_model_len=MAX_MODEL_LEN,
                                    log_path=self.work / "vllm.log", as_users_run=True).start()
        self.server.wait_healthy(timeout=900)
        return self.server.base_url

    def processes(self) -> dict[str, psutil.Process]:
        root = psutil.Process(self.server.pid)
        found = {"API server": root}
        for child in root.children(recursive=True):
            try:
                if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
                    found["EngineCore (info)"] = child
            except psutil.Error:
                pass
        return found

    def stop(self) -> None:
        self.server.stop()


# ----------------------------------------------------------------------------- one run


@dataclass
class RunResult:
    setup: str
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    unloaded_p50_s: float
    unloaded_n: int
    loaded_p50_s: float
    loaded_p95_s: float
    loaded_max_s: float
    loaded_n: int
    lost: int
    lost_examples: list[str]
    answers: list[Answer]
    unsent: int
    slow: SlowStats
    rss_mb: dict[str, dict[str, float]]  # label -> baseline / peak / after
    abuse_seconds: float


async def _abuse(port: int, bodies: dict[str, tuple[str, bytes | list[bytes]]], schedule: list[str], timeout_s: float,
                 deadline_s: float, slow_stats: SlowStats) -> tuple[list[Answer], int]:
    stop_slow = asyncio.Event()
    slow = [asyncio.create_task(slow_connection(port, i >= SLOW_HEADERS, stop_slow, slow_stats, i))
            for i in range(SLOW_HEADERS + SLOW_BODIES)]
    await asyncio.sleep(3.0)  # they are open and trickling before the bodies come
    queue = list(enumerate(schedule))
    answers: list[Answer] = []
    deadline = time.monotonic() + deadline_s

    async def worker() -> None:
        while queue and time.monotonic() < deadline:
            index, kind = queue.pop(0)
            route, body = bodies[kind]
            if isinstance(body, list):  # distinct bodies of one kind, in turn
                body = body[index % len(body)]
            answers.append(await send_abusive(port, kind, route, body, timeout_s))

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    stop_slow.set()
    await asyncio.gather(*slow, return_exceptions=True)
    return answers, len(queue)


def run_once(setup: Any, base_url: str, bodies: dict[str, tuple[str, bytes]], schedule: list[str], args: argparse.Namespace) -> RunResult:
    port = int(base_url.rsplit(":", 1)[1])
    load_before = os.getloadavg()
    procs = setup.processes()
    sampler = RssSampler(procs)
    sampler.start()
    # Warm-up, then the unloaded reference.
    probe = Probe(base_url)
    probe.start()
    time.sleep(3.0)
    probe.stop()
    probe = Probe(base_url)
    probe.start()
    time.sleep(args.unloaded_s)
    probe.stop()
    unloaded = [s for _, s, st in probe.results if st == 200]
    t_base = time.monotonic()
    baseline_rows = sampler.window(t_base - min(5.0, args.unloaded_s), t_base)

    probe = Probe(base_url)
    probe.start()
    slow_stats = SlowStats()
    t_abuse = time.monotonic()
    answers, unsent = asyncio.run(_abuse(port, bodies, schedule, args.request_timeout_s, args.deadline_s, slow_stats))
    t_end = time.monotonic()
    time.sleep(args.settle_s)
    probe.stop()
    t_after = time.monotonic()
    sampler.stop_event.set()
    sampler.join()

    loaded = [r for r in probe.results]
    ok = [s for _, s, st in loaded if st == 200]
    lost = [f"{st} after {s:.1f} s" for _, s, st in loaded if st != 200]
    rss: dict[str, dict[str, float]] = {}
    peak_rows = sampler.window(t_abuse, t_after)
    after_rows = sampler.window(t_after - 1.0, t_after)
    for label in procs:
        def mean(rows: list[dict[str, int]]) -> float:
            vals = [r[label] for r in rows if label in r]
            return statistics.mean(vals) / 2**20 if vals else float("nan")
        rss[label] = {
            "baseline": mean(baseline_rows),
            "peak": max((r[label] for r in peak_rows if label in r), default=0) / 2**20,
            "after": mean(after_rows),
        }
    return RunResult(
        setup=setup.name, load_before=load_before, load_after=os.getloadavg(),
        unloaded_p50_s=pct(unloaded, 50), unloaded_n=len(unloaded),
        loaded_p50_s=pct(ok, 50), loaded_p95_s=pct(ok, 95), loaded_max_s=max(ok, default=float("nan")),
        loaded_n=len(loaded), lost=len(lost), lost_examples=lost[:5], answers=answers, unsent=unsent,
        slow=slow_stats, rss_mb=rss, abuse_seconds=t_end - t_abuse,
    )


# ----------------------------------------------------------------------------- report


def _answer_ok(a: Answer) -> bool:
    if a.kind == LARGE_IMAGE and a.status == 200:
        return True  # an honest request, served
    return a.status is not None and (400 <= a.status < 500 or a.status == 503) and a.openai_shape and (a.status != 503 or a.retry_after)


def run_summary(r: RunResult) -> dict[str, Any]:
    by_kind: dict[str, dict[str, Any]] = {}
    for a in r.answers:
        k = by_kind.setdefault(a.kind, {"n": 0, "codes": {}, "seconds": [], "ok": 0, "examples": set()})
        k["n"] += 1
        code = str(a.status) if a.status is not None else a.failure
        k["codes"][code] = k["codes"].get(code, 0) + 1
        k["seconds"].append(a.seconds)
        k["ok"] += _answer_ok(a)
        if a.message:
            k["examples"].add(f"{a.status}: {a.message[:100]}")
    return by_kind


def _ratio(r: RunResult) -> float:
    return r.loaded_p50_s / r.unloaded_p50_s if r.unloaded_p50_s else float("nan")


def med(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def markdown(results: list[RunResult], args: argparse.Namespace, command: str) -> str:
    setups = list(dict.fromkeys(r.setup for r in results))
    per = {s: [r for r in results if r.setup == s] for s in setups}
    out = [
        "# Abuse: mmserve vs vLLM's own server (issue 8)", "",
        f"Command: `{command}`", "",
        f"Machine: {platform.machine()}, {psutil.cpu_count()} logical cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; "
        f"other jobs may share it (load averages below). Bodies: ≈{args.scale * 30:.0f} MB each; {args.per_kind} per abusive kind, "
        f"{args.text_prompts} text prompts; {CONCURRENCY} at a time; {SLOW_HEADERS} slow-header + {SLOW_BODIES} slow-body connections; "
        f"request timeout {args.request_timeout_s:.0f} s, abuse phase cut off after {args.deadline_s:.0f} s (unsent requests counted). "
        f"Medians over {args.repeats} repeats on one running setup each.", "",
        "## Side by side (medians over repeats)", "",
        "| | " + " | ".join(setups) + " |", "|---|" + "---:|" * len(setups),
    ]

    def row(label: str, fn) -> None:
        out.append(f"| {label} | " + " | ".join(fn(per[s]) for s in setups) + " |")

    row("load average (1 min) before each run", lambda rs: ", ".join(f"{r.load_before[0]:.1f}" for r in rs))
    row("probe p50 unloaded", lambda rs: f"{med([r.unloaded_p50_s for r in rs]) * 1000:.0f} ms")
    row("probe p50 under abuse", lambda rs: f"{med([r.loaded_p50_s for r in rs]) * 1000:.0f} ms")
    row("**ratio (≤ 3× required)**", lambda rs: f"**{med([_ratio(r) for r in rs]):.2f}×** ({', '.join(f'{_ratio(r):.2f}' for r in rs)})")
    row("probe p95 / max under abuse", lambda rs: f"{med([r.loaded_p95_s for r in rs]) * 1000:.0f} / {med([r.loaded_max_s for r in rs]) * 1000:.0f} ms")
    row("**probes lost** (per run)", lambda rs: "**" + ", ".join(f"{r.lost}/{r.loaded_n}" for r in rs) + "**")
    row("abusive requests answered 4xx/503 in OpenAI's shape (per run)",
        lambda rs: ", ".join(f"{sum(_answer_ok(a) for a in r.answers)}/{len(r.answers) + r.unsent}" for r in rs))
    row("abuse phase duration", lambda rs: f"{med([r.abuse_seconds for r in rs]):.0f} s")
    labels = list(dict.fromkeys(label for s in setups for r in per[s] for label in r.rss_mb))
    for label in labels:
        def rss(rs: list[RunResult], label: str = label) -> str:
            have = [r.rss_mb[label] for r in rs if label in r.rss_mb]
            if not have:
                return "—"
            b, p, a = (med([h[k] for h in have]) for k in ("baseline", "peak", "after"))
            return f"{b:.0f} → {p:.0f} (+{p - b:.0f}) → {a:.0f} (+{a - b:.0f})"
        row(f"RSS MB {label}: baseline → peak → {args.settle_s:.0f} s after", rss)
    out += ["", "## Each abusive kind (all repeats pooled)", "",
            "| setup | kind | n | status codes | time to answer p50 / max | OpenAI error shape |", "|---|---|---:|---|---:|---:|"]
    for s in setups:
        pooled: dict[str, dict[str, Any]] = {}
        for r in per[s]:
            for kind, k in run_summary(r).items():
                p = pooled.setdefault(kind, {"n": 0, "codes": {}, "seconds": [], "ok": 0, "examples": set()})
                p["n"] += k["n"]
                p["ok"] += k["ok"]
                p["seconds"] += k["seconds"]
                p["examples"] |= k["examples"]
                for c, v in k["codes"].items():
                    p["codes"][c] = p["codes"].get(c, 0) + v
        for kind, p in pooled.items():
            codes = ", ".join(f"{c}×{v}" for c, v in sorted(p["codes"].items()))
            out.append(f"| {s} | {kind} | {p['n']} | {codes} | {pct(p['seconds'], 50):.1f} / {max(p['seconds']):.1f} s | {p['ok']}/{p['n']} |")
        unsent = sum(r.unsent for r in per[s])
        if unsent:
            out.append(f"| {s} | (not sent before the cut-off) | {unsent} | | | |")
    out += ["", "## Per run", ""]
    for r in results:
        out.append(f"- {r.setup}: load {r.load_before[0]:.1f} → {r.load_after[0]:.1f}; probe unloaded p50 "
                   f"{r.unloaded_p50_s * 1000:.0f} ms (n={r.unloaded_n}), under abuse p50 {r.loaded_p50_s * 1000:.0f} ms "
                   f"p95 {r.loaded_p95_s * 1000:.0f} ms (n={r.loaded_n}), lost {r.lost} {r.lost_examples}; "
                   f"slow connections opened {r.slow.opened}, closed by the server {r.slow.closed_by_server} "
                   f"(answers {r.slow.answered}); abuse {r.abuse_seconds:.0f} s; RSS MB "
                   + "; ".join(f"{k} {v['baseline']:.0f}/{v['peak']:.0f}/{v['after']:.0f}" for k, v in r.rss_mb.items()))
    out += ["", "Example answers:", ""]
    for s in setups:
        seen: set[str] = set()
        for r in per[s]:
            for kind, k in run_summary(r).items():
                for e in sorted(k["examples"])[:2]:
                    if (kind, e) not in seen:
                        seen.add((kind, e))
                        out.append(f"- {s}, {kind}: `{e}`")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- main


def build_model(dest: Path) -> Path:
    if not (dest / "model.safetensors").exists():
        import subprocess
        from tests.support.reference_venv import reference_python
        subprocess.run([reference_python(), "-c", "import sys; from tests.support.tiny_models import build_tiny_qwen2_vl as b; "
                        "b(sys.argv[1], seed=0)", str(dest)], cwd=REPO, check=True)
    return dest


def load_results(path: str, exclude: list[str]) -> list[RunResult]:
    names = {"mmserve": MmserveSetup.name, "vllm": VllmSetup.name}
    skip = {names.get(e, e) for e in exclude}
    out = []
    for d in json.loads(Path(path).read_text()):
        if d["setup"] in skip:
            continue
        d["answers"] = [Answer(**a) for a in d["answers"]]
        d["slow"] = SlowStats(**{**d["slow"], "answered": {int(k): v for k, v in d["slow"]["answered"].items()}})
        out.append(RunResult(**d))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setups", default="mmserve,vllm")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--per-kind", type=int, default=20)
    parser.add_argument("--text-prompts", type=int, default=10)
    parser.add_argument("--scale", type=float, default=1.0, help="body size in units of 30 MB (smoke tests: 0.1)")
    parser.add_argument("--unloaded-s", type=float, default=20.0)
    parser.add_argument("--settle-s", type=float, default=60.0)
    parser.add_argument("--request-timeout-s", type=float, default=180.0)
    parser.add_argument("--deadline-s", type=float, default=600.0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "abuse.md"))
    parser.add_argument("--serve-env", action="append", default=[], help="KEY=VALUE for serve run (e.g. glibc malloc settings)")
    parser.add_argument("--reuse", help="a results JSON of an earlier run: its runs of setups not run now are reported too")
    args = parser.parse_args()
    command = "python bench/abuse_bench.py " + " ".join(sys.argv[1:])

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(REPO / ".cache" / "bench_models" / MODEL_NAME)
    bodies: dict[str, tuple[str, bytes | list[bytes]]] = dict(make_bodies(int(30 * MB * args.scale)))
    bodies[LARGE_IMAGE] = ("/v1/chat/completions", large_image_bodies(args.per_kind))
    schedule = abuse_schedule(args.per_kind, args.text_prompts)
    print({k: f"{len(b if isinstance(b, bytes) else b[0]) / MB:.1f} MB" for k, (_, b) in bodies.items()},
          f"{len(schedule)} abusive requests", flush=True)
    results: list[RunResult] = load_results(args.reuse, exclude=args.setups.split(",")) if args.reuse else []
    for name in args.setups.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"abuse_{name}_"))
        setup = MmserveSetup(model_dir, work, dict(e.split("=", 1) for e in args.serve_env)) if name == "mmserve" else VllmSetup(model_dir, work)
        print(f"== {setup.name}: starting (logs in {work})", flush=True)
        base_url = setup.start()
        try:
            for i in range(args.repeats):
                r = run_once(setup, base_url, bodies, schedule, args)
                results.append(r)
                Path(args.out).with_suffix(".partial.json").write_text(json.dumps([asdict(x) for x in results], default=str))
                print(f"-- {setup.name} run {i + 1}: ratio {_ratio(r):.2f}, lost {r.lost}/{r.loaded_n}, "
                      f"ok answers {sum(_answer_ok(a) for a in r.answers)}/{len(r.answers) + r.unsent}, rss {r.rss_mb}", flush=True)
        finally:
            setup.stop()
        if not os.environ.get("MMSERVE_BENCH_KEEP_LOGS"):
            shutil.rmtree(work, ignore_errors=True)
    text = markdown(results, args, command)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = ""
    if out.exists() and OBSERVATIONS_MARKER in out.read_text():
        kept = out.read_text().split(OBSERVATIONS_MARKER, 1)[1]
    out.write_text(text + "\n" + OBSERVATIONS_MARKER + kept)
    out.with_suffix(".json").write_text(json.dumps([asdict(r) for r in results], indent=1, default=str))
    print(text)


if __name__ == "__main__":
    main()

"""Image chats end to end: the mmserve Serve graph vs vLLM's own OpenAI server.

    python bench/image_chat_bench.py [--quick] [--out bench/results/image_chat.md]

Two setups on the same tiny random Qwen2-VL (`tests/support/tiny_models.py`), run one after the
other, never at the same time:

- **vLLM server**: `vllm serve` (its own OpenAI server; images are preprocessed in its API
  process by the HF processor, the model runs in its EngineCore child process).
- **mmserve**: our Serve graph (proxy → ingress → preprocessor deployment, autoscaled → engine
  client) in front of `vllm serve --headless`, default pixel mode (`device_normalize`: uint8
  patches, the engine normalises).

Streaming chat completions, greedy, `ignore_eos`, max_tokens 8 (engine work per request is
identical in both setups: the prompt-token counts are printed to check it), closed loop at
concurrency 1, 8 (and 16 without `--quick`), with 1 or 4 JPEG images per request at 640×480 and
1280×960, sent as data URIs. Both sizes are resized to the same 364×504 pixels (max_pixels
200 704), so they cost the engine the same; only decoding and resizing differ. Every request
carries images nobody has seen before (so no multimodal cache can help); both setups get the
very same images in the same order. One extra cell sends the *same* four images in every
request, to show what caches (vLLM's processor cache; the engine's encoder and prefix caches,
keyed on our content hash) save.

Per cell: requests/s, TTFT p50/p90 (first token chunk, not the role chunk), request latency,
CPU cores used per process group (psutil, user + system, over the measured phase), and for
mmserve the preprocessor replicas (`serve.status()`, RUNNING) at the start and the most seen
during the cell (polled every 0.5 s). Cells run in a fixed order on one deployment, so replicas
scaled up in one cell carry over into the next (downscale delay 10 s).

Reuses `bench/gateway_bench.py`'s client, statistics, CPU meter, Ray start and deploy helpers.
Not a test: nothing is asserted about timings. Everything shares 2 cores with the client.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gateway_bench as gb  # noqa: E402  (sets RAY_AUTH_MODE etc. and puts the repo on sys.path)

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from PIL import Image  # noqa: E402

REPO = gb.REPO
MODEL_NAME = gb.MODEL_NAME
APP = "bench_img"
MAX_TOKENS = 8
MAX_MODEL_LEN = 2048  # 4 images × 234 tokens + text
SIZES = [(640, 480), (1280, 960)]
VLLM_SETUP = "vLLM server"
OURS_SETUP = "mmserve + headless"
OBSERVATIONS_MARKER = "<!-- observations: hand-written below this line; kept when the script rewrites the file -->"

# Process groups, in display order (labels of gateway_bench's classifier, refined below).
GROUPS = [
    ("client", "bench client (+ Ray driver)"),
    ("proxy", "Serve proxy"),
    ("ingress", "ingress replica"),
    ("preproc", "preprocessor replicas"),
    ("engine client", "engine-client replica"),
    ("Ray other", "Ray (controller, raylet, GCS, workers)"),
    ("vLLM API server", "vLLM API server process"),
    ("headless launcher", "vllm serve --headless launcher"),
    ("EngineCore", "vLLM EngineCore"),
    ("vLLM worker", "vLLM model worker"),
]


# ----------------------------------------------------------------------------- CPU groups

_base_classify = gb._classify
_vllm_root: dict[str, Any] = {"pid": None, "label": None}


def _classify(proc: psutil.Process, vllm_pids: set[int]) -> str:
    """gateway_bench's groups, plus the preprocessor replicas and vLLM's front-end vs EngineCore."""
    kind = _base_classify(proc, vllm_pids)
    if kind == "vLLM processes":
        if proc.pid == _vllm_root["pid"]:
            return _vllm_root["label"]
        try:
            # vLLM's CPU backend runs the model in a `VLLM::Worker` child of the EngineCore, its
            # OpenMP threads bound to core 0 (core 1 reserved for the rest); it spins between steps.
            return "vLLM model worker" if "Worker" in proc.name() else "vLLM EngineCore"
        except psutil.Error:
            return "vLLM EngineCore"
    if kind.startswith("Ray"):
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            return kind
        if "ServeReplica" in cmd and ":Preprocessor" in cmd:
            return "preprocessor replicas"
    return kind


gb._classify = _classify  # CpuMeter looks the classifier up at call time


# ----------------------------------------------------------------------------- images and requests


class ImageMaker:
    """Distinct JPEG data URIs: a smooth gradient plus mild noise, varied per seed (image shifted,
    colours offset per channel, a flat block of a random colour placed at random), quality 90."""

    def __init__(self, width: int, height: int) -> None:
        self.w, self.h = width, height
        rng = np.random.default_rng(width * 7 + height)
        y, x = np.mgrid[0:height, 0:width]
        base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) * 127 // max(width + height, 1)], -1)
        self.base = np.clip(base + rng.integers(-12, 13, size=(height, width, 3)), 0, 255).astype(np.uint8)

    def uri(self, seed: int) -> str:
        rng = np.random.default_rng(seed)
        arr = np.roll(self.base, (seed * 37 % self.h, seed * 61 % self.w), axis=(0, 1))
        arr += rng.integers(0, 256, 3, dtype=np.uint8)  # wraps around: a different palette per seed
        bh, bw = self.h // 6, self.w // 6
        y0, x0 = int(rng.integers(0, self.h - bh)), int(rng.integers(0, self.w - bw))
        arr[y0:y0 + bh, x0:x0 + bw] = rng.integers(0, 256, 3, dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, "JPEG", quality=90)
        return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_body(uris: list[str]) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in uris]
    content.append({"type": "text", "text": "Describe the picture." if len(uris) == 1 else "Compare these pictures."})
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass
class Cell:
    size: tuple[int, int]
    images: int
    concurrency: int
    requests: int
    repeated: bool = False
    bodies: list[dict[str, Any]] = field(default_factory=list)
    jpeg_kb: float = 0.0

    @property
    def label(self) -> str:
        w, h = self.size
        return f"{self.images}× {w}×{h}" + (" **same images**" if self.repeated else "")


def plan(quick: bool) -> list[Cell]:
    counts = {1: 6, 8: 24} if quick else {1: 16, 8: 64, 16: 96}
    cells = [Cell(size, n, c, counts[c]) for size in SIZES for n in (1, 4) for c in counts]
    # Same concurrency and images as a distinct-image cell, but the same four images every time.
    cells.append(Cell(SIZES[1], 4, 8, counts[8], repeated=True))
    return cells


def make_bodies(cells: list[Cell], warmup: int) -> list[dict[str, Any]]:
    """Fill each cell's bodies (distinct images across the whole plan) and return warm-up bodies."""
    makers = {size: ImageMaker(*size) for size in SIZES}
    seeds: Iterator[int] = iter(range(1, 10**9))
    t0 = time.time()
    for cell in cells:
        maker = makers[cell.size]
        if cell.repeated:
            fixed = [maker.uri(next(seeds)) for _ in range(cell.images)]
            cell.bodies = [chat_body(fixed) for _ in range(cell.requests)]
        else:
            cell.bodies = [chat_body([maker.uri(next(seeds)) for _ in range(cell.images)]) for _ in range(cell.requests)]
        uris = [p["image_url"]["url"] for b in cell.bodies for p in b["messages"][0]["content"] if p["type"] == "image_url"]
        cell.jpeg_kb = sum(len(u) for u in uris) / len(uris) * 3 / 4 / 1024
    # Warm-up: every size, 1 and 4 images, images of their own.
    warm = [chat_body([makers[size].uri(next(seeds)) for _ in range(n)]) for _ in range(warmup) for size in SIZES for n in (1, 4)]
    print(f"made the images in {time.time() - t0:.1f} s", flush=True)
    return warm


# ----------------------------------------------------------------------------- load


async def closed_loop(url: str, bodies: list[dict[str, Any]], concurrency: int, max_s: float) -> tuple[list[gb.Stream], float, int]:
    """`concurrency` workers take the next body until none is left or `max_s` has passed."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    todo = iter(bodies)
    results: list[gb.Stream] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        start = time.time()
        deadline = start + max_s

        async def worker() -> None:
            for body in todo:
                results.append(await gb.stream_one(client, url, body))
                if time.time() > deadline:
                    return

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.time() - start
    for s in results:
        s.parse()
    bad = [s for s in results if s.status != 200 or s.error or not s.chunk_times]
    if bad:
        print(f"  !! {len(bad)} failed request(s), e.g. status {bad[0].status}: {bad[0].error}", flush=True)
    return [s for s in results if s not in bad], elapsed, len(bad)


class ReplicaWatch:
    """RUNNING preprocessor replicas: at the start and the most seen, polling serve.status()."""

    def __init__(self, app: str | None) -> None:
        self.app = app
        self.first: int | None = None
        self.most = 0
        self._stop = threading.Event()

    @staticmethod
    def running(app: str) -> int:
        from ray import serve

        try:
            dep = serve.status().applications[app].deployments["Preprocessor"]
        except Exception:
            return 0
        return sum(n for state, n in dep.replica_states.items() if str(getattr(state, "value", state)).upper() == "RUNNING")

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self.most = max(self.most, self.running(self.app))  # type: ignore[arg-type]

    def __enter__(self) -> ReplicaWatch:
        if self.app:
            self.first = self.most = self.running(self.app)
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.app:
            self._stop.set()
            self._thread.join()
            self.most = max(self.most, self.running(self.app))

    def describe(self) -> str:
        return "–" if self.first is None else f"{self.first} → {self.most}"


@dataclass
class Result:
    setup: str
    cell: Cell
    requests: int
    failed: int
    elapsed: float
    ttft: list[float]
    latency: list[float]
    prompt_tokens: set[int]
    cpu: gb.CpuMeter
    replicas: ReplicaWatch

    @property
    def rps(self) -> float:
        return self.requests / self.elapsed if self.elapsed else 0.0

    def cores(self, kind: str) -> float:
        return self.cpu.by_kind.get(kind, 0.0) / self.cpu.wall

    @property
    def others(self) -> float:
        return max(0.0, self.cpu.machine_busy - self.cpu.total) / self.cpu.wall


def run_cell(setup: str, url: str, cell: Cell, vllm_root: int, app: str | None, max_s: float) -> Result:
    with ReplicaWatch(app) as replicas, gb.CpuMeter(vllm_root) as cpu:
        streams, elapsed, failed = asyncio.run(closed_loop(url, cell.bodies, cell.concurrency, max_s))
    r = Result(setup, cell, len(streams), failed, elapsed, [s.ttft for s in streams],
               [s.chunk_times[-1] - s.t_send for s in streams], {s.prompt_tokens for s in streams if s.prompt_tokens}, cpu, replicas)
    print(f"  {cell.label:>26} c={cell.concurrency:<2} {r.requests:3d} req in {elapsed:5.1f} s: {r.rps:6.2f} req/s, "
          f"TTFT p50 {gb.pct(r.ttft, .5) * 1e3:7.1f} p90 {gb.pct(r.ttft, .9) * 1e3:7.1f} ms, prompt tokens {sorted(r.prompt_tokens)}, "
          f"preproc replicas {replicas.describe()}, CPU {cpu.total / cpu.wall:.2f}", flush=True)
    return r


def warm_up(url: str, bodies: list[dict[str, Any]]) -> None:
    t0 = time.time()
    streams, _, failed = asyncio.run(closed_loop(url, bodies, 2, 120))
    print(f"  warm-up: {len(streams)} ok, {failed} failed, {time.time() - t0:.1f} s", flush=True)


# ----------------------------------------------------------------------------- report


def report_tables(results: list[Result]) -> str:
    by = {(r.setup, id(r.cell)): r for r in results}
    cells = list(dict.fromkeys(id(r.cell) for r in results))
    cell_of = {id(r.cell): r.cell for r in results}
    setups = list(dict.fromkeys(r.setup for r in results))
    main = [
        "| images per request | conc. | setup | requests (failed) | **requests/s** | **TTFT ms p50 / p90** | latency ms p50 / p90 | prompt tokens | preproc replicas start → max | CPU cores used (of 2) | CPU s per request |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    kinds = [k for k in GROUPS if any(r.cpu.by_kind.get(k[1], 0.0) / r.cpu.wall >= 0.005 for r in results)]
    cpu = [
        "| images per request | conc. | setup | " + " | ".join(short for short, _ in kinds) + " | other jobs |",
        "|---|---:|---|" + "---:|" * (len(kinds) + 1),
    ]
    for cid in cells:
        cell = cell_of[cid]
        rs = [by[(s, cid)] for s in setups if (s, cid) in by]
        for r in rs:
            lead = f"| {cell.label} | {cell.concurrency} | {r.setup} |"
            main.append(
                f"{lead} {r.requests} ({r.failed}) | {r.rps:.2f} | {gb.pct(r.ttft, .5) * 1e3:.0f} / {gb.pct(r.ttft, .9) * 1e3:.0f} "
                f"| {gb.pct(r.latency, .5) * 1e3:.0f} / {gb.pct(r.latency, .9) * 1e3:.0f} | {', '.join(map(str, sorted(r.prompt_tokens)))} "
                f"| {r.replicas.describe()} | {r.cpu.total / r.cpu.wall:.2f} | {r.cpu.total / max(r.requests, 1):.3f} |"
            )
            cpu.append(lead + " ".join(f" {r.cores(kind):.2f} |" if r.cores(kind) >= 0.005 else " – |" for _, kind in kinds) + f" {r.others:.2f} |")
        if len(rs) == 2 and rs[0].rps and rs[0].ttft and rs[1].ttft:
            a, b = rs
            main.append(
                f"| {cell.label} | {cell.concurrency} | *{b.setup} / {a.setup}* | | {b.rps / a.rps:.2f}× | {gb.pct(b.ttft, .5) / gb.pct(a.ttft, .5):.2f}× (p50) "
                f"| {gb.pct(b.latency, .5) / gb.pct(a.latency, .5):.2f}× (p50) | | | | {(b.cpu.total / max(b.requests, 1)) / (a.cpu.total / max(a.requests, 1)):.2f}× |"
            )
    legend = "; ".join(f"{short} = {kind}" for short, kind in kinds)
    return "\n".join(main) + "\n\nCPU cores used per process group (CPU seconds over the measured phase / its wall time; " + legend + "; other jobs = the machine's busy CPU minus ours):\n\n" + "\n".join(cpu)


def keep_observations(out: Path) -> str:
    try:
        text = out.read_text()
    except OSError:
        return ""
    i = text.find(OBSERVATIONS_MARKER)
    return text[i + len(OBSERVATIONS_MARKER):] if i >= 0 else ""


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests, no concurrency 16 (≈3 min; full run ≈5 min)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "image_chat.md"))
    parser.add_argument("--cell-seconds", type=float, default=None, help="stop sending new requests in a cell after this (default 20, quick 12)")
    parser.add_argument("--setup", action="append", choices=[VLLM_SETUP, OURS_SETUP], help="only these setups")
    parser.add_argument("--model-dir", help="an existing tiny Qwen2-VL dir (default: build one in a temp dir)")
    args = parser.parse_args()
    command = " ".join(["python bench/image_chat_bench.py", *(shlex.quote(a) for a in sys.argv[1:])])
    max_s = args.cell_seconds or (12.0 if args.quick else 20.0)
    setups = args.setup or [VLLM_SETUP, OURS_SETUP]
    started = time.time()
    load_start = os.getloadavg()
    facts = gb.machine_facts()
    print(facts, flush=True)

    cells = plan(args.quick)
    warm = make_bodies(cells, warmup=2)
    results: list[Result] = []
    tmp = Path(tempfile.mkdtemp(prefix="image_chat_bench_"))
    from tests.support.vllm_engines import HeadlessVllmEngine, VllmApiServer, free_tcp_port

    try:
        if args.model_dir:
            model_dir = Path(args.model_dir)
        else:
            from tests.support.tiny_models import build_tiny_qwen2_vl

            model_dir = build_tiny_qwen2_vl(tmp / MODEL_NAME, seed=0)

        if VLLM_SETUP in setups:
            # vLLM's own server first, before Ray exists.
            print(f"== {VLLM_SETUP}", flush=True)
            server = VllmApiServer(model_dir, served_model_name=MODEL_NAME, max_model_len=MAX_MODEL_LEN, log_path=tmp / "vllm_server.log",
                                   as_users_run=True).start()
            _vllm_root.update(pid=server.pid, label="vLLM API server process")
            try:
                server.wait_healthy(timeout=300)
                url = server.base_url + "/v1/chat/completions"
                warm_up(url, warm)
                for cell in cells:
                    results.append(run_cell(VLLM_SETUP, url, cell, server.pid, None, max_s))
            finally:
                server.stop()

        if OURS_SETUP in setups:
            print(f"== {OURS_SETUP}", flush=True)
            port = gb.start_ray({})
            try:
                from ray import serve

                hs_port = free_tcp_port()
                engine = HeadlessVllmEngine(model_dir, hs_port, max_model_len=MAX_MODEL_LEN, log_path=tmp / "vllm_headless.log",
                                            as_users_run=True).start()
                _vllm_root.update(pid=engine.pid, label="vllm serve --headless launcher")
                try:
                    base = gb.deploy(port, APP, {
                        "model": str(model_dir), "served_model_name": MODEL_NAME,
                        "engines": [f"tcp://127.0.0.1:{hs_port}"], "handshake_timeout_s": 600, "health_check_timeout_s": 30,
                    }, 600)
                    url = base + "/v1/chat/completions"
                    warm_up(url, warm)
                    for cell in cells:
                        results.append(run_cell(OURS_SETUP, url, cell, engine.pid, APP, max_s))
                    serve.delete(APP)
                finally:
                    engine.stop()
            finally:
                import ray
                from ray import serve

                serve.shutdown()
                ray.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    load_end = os.getloadavg()
    kept = keep_observations(Path(args.out))
    sizes = ", ".join(f"{w}×{h} (JPEG q90, ≈{np.mean([c.jpeg_kb for c in cells if c.size == (w, h)]):.0f} KB)" for w, h in SIZES)
    sections = [
        "## Image chats: mmserve (Serve graph + `vllm serve --headless`) vs `vllm serve`'s OpenAI server",
        "",
        f"Command: `{command}` (total {time.time() - started:.0f} s). Re-run on a quiet machine with `python bench/image_chat_bench.py`.",
        facts,
        f"Load average (1/5/15 min): {' / '.join(f'{x:.2f}' for x in load_start)} at start, {' / '.join(f'{x:.2f}' for x in load_end)} at the end. "
        "Everything (client, Ray, gateway, engines) shares the 2 cores: numbers are upper bounds, and on a busy machine they move a lot.",
        "",
        f"Tiny random Qwen2-VL, bf16, `--enforce-eager`, max_model_len {MAX_MODEL_LEN}, both setups with vLLM's defaults otherwise "
        f"(prefix caching, processor cache). Streaming chat, greedy, `ignore_eos`, max_tokens {MAX_TOKENS}; closed loop; each cell stops "
        f"sending after {max_s:g} s. Images: {sizes}, data URIs, all distinct across the whole run except in the *same images* cell "
        "(the same 4 images in every request); both setups get identical requests in the same order. "
        "mmserve: Serve defaults, pixel mode `device_normalize`, preprocessor autoscaling 1–4 replicas "
        "(target 2 ongoing, upscale delay 2 s, downscale delay 10 s, 1 CPU each), cells run back to back on one deployment. "
        "TTFT = first chunk carrying a token (not the role chunk). Ratios: mmserve / vLLM (> 1 on requests/s is better, on TTFT and CPU worse).",
        "",
        report_tables(results),
        "",
        OBSERVATIONS_MARKER,
    ]
    text = "\n".join(sections) + (kept if kept else "\n")
    print("\n" + "\n".join(sections[:-1]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

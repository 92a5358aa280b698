"""How many requests one front-end core carries: mmserve against vLLM's own API server, each alone on one
core, both driving the same engine stand-in at a GPU's speed.

    .venv/bin/python bench/capacity_bench.py [--runs 3] [--quick] [--out bench/results/capacity.md]
        [--front-cpu 0] [--engine-cpu 1] [--systems vllm,mmserve] [--api-server-count 1]

The machine is split in two. On `--engine-cpu`: the engine stand-in (the built-in engine as its own
process, `python -m mmserve.builtin_engine`, its steps as long as a GPU's, `builtin_engine.*` defaults)
and this process, the load client (`sse_client.py`: raw keep-alive connections, no JSON parsed per
chunk). On `--front-cpu`: one front end at a time, every process and thread of it:

- **vLLM**: `vllm serve MODEL --data-parallel-size-local 0 --data-parallel-address 127.0.0.1
  --data-parallel-rpc-port PORT [--api-server-count N]`: vLLM's API server with no engine of its own;
  the stand-in connects to it as a headless vLLM engine would;
- **mmserve**: `serve run serve_app:build_app model=MODEL engines=tcp://127.0.0.1:PORT` with the Ray
  instance's settings of README's quick start (`cluster/ray.env`): Ray's and Serve's processes too.

Each front end is checked to run on its core only (every thread's affinity), the stand-in and the
client on theirs. A phase is void (marked, left out of the medians) when the engine's core is more than
85 % busy: then the stand-in or the client, not the front end, limited it.

Workloads (streamed chat, `ignore_eos`): text, ≈128 prompt tokens, 256 out; one distinct 640×480 JPEG
data URI per request, 16 out; the same image in every request, 16 out. Per workload:

- **capacity**: a closed loop at rising concurrency; capacity is the highest req/s of the ramp, per
  front-end core (req/s ÷ the front-end core's busy share), with output tokens/s and the front end's CPU
  per request by process at that level;
- **latency under load**: an open loop, Poisson arrivals at 50 % and 80 % of the lower of the two
  systems' capacities (medians over the runs), TTFT and TPOT p50/p99.

Runs alternate the systems' order; the capacities of all runs are measured before the latency phases.
Writes the markdown report and the per-run JSON beside it. Not a test: nothing is asserted about timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import frontend_bench as fb  # noqa: E402  (puts the repository on sys.path)
import image_chat_bench as ic  # noqa: E402
import sse_client  # noqa: E402

import httpx  # noqa: E402
import psutil  # noqa: E402

from serve_app.config import AppConfig  # noqa: E402
from tests.support.tiny_models import build_tiny_qwen2_vl  # noqa: E402
from tests.support.vllm_engines import VllmApiServer, free_tcp_port  # noqa: E402

MODEL_NAME = fb.MODEL_NAME
MAX_MODEL_LEN = fb.MAX_MODEL_LEN
SYSTEMS = ("vllm", "mmserve")
FRONT, ENGINE, CLIENT = "front end", "engine stand-in", "client"
VOID_ENGINE_CPU_BUSY = 0.85
LATENCY_LOADS = (0.5, 0.8)


@dataclass(frozen=True)
class Workload:
    name: str
    max_tokens: int
    ramp: tuple[int, ...]  # concurrency levels of the capacity ramp


WORKLOADS = (
    Workload("text", 256, (32, 64, 128, 256)),
    Workload("new image", 16, (8, 16, 32, 64)),
    Workload("repeated image", 16, (16, 32, 64, 128)),
)
# At capacity a front end is its core's bottleneck only when it keeps the core this busy; below, the
# stand-in's modelled GPU (or the client) held the requests back, and the capacity is a lower bound.
FRONT_BOUND_BUSY = 0.9


@dataclass
class Phase:
    """One measured phase: a ramp level (closed loop) or a latency load (open loop)."""

    workload: str
    kind: str  # "closed c=N" or "poisson R/s"
    ok: int
    failed: int
    failure_examples: list[str]
    wall_s: float
    output_tokens: int
    ttft_ms: dict[str, float]  # p50, p99
    tpot_ms: dict[str, float]
    cpu_busy: dict[str, float]  # "front" / "engine" core: busy share over the phase
    cpu_s: dict[str, dict[str, float]]  # role -> process label -> CPU seconds
    prompt_tokens: float = float("nan")  # median, as the front end counted them

    @property
    def rps(self) -> float:
        return self.ok / self.wall_s if self.wall_s else 0.0

    @property
    def void(self) -> bool:
        return self.cpu_busy["engine"] > VOID_ENGINE_CPU_BUSY

    @property
    def rps_per_front_core(self) -> float:
        return self.rps / max(self.cpu_busy["front"], 1e-9)

    def ms_per_request(self, role: str) -> float:
        return sum(self.cpu_s.get(role, {}).values()) / self.ok * 1e3 if self.ok else float("nan")


@dataclass
class SystemRun:
    system: str
    run: int
    part: str  # "capacity" or "latency"
    phases: list[Phase] = field(default_factory=list)

    def capacity(self, workload: str) -> Phase | None:
        """The ramp level with the most requests per second (void levels left out)."""
        levels = [p for p in self.phases if p.workload == workload and p.kind.startswith("closed") and not p.void]
        return max(levels, key=lambda p: p.rps, default=None)


# ----------------------------------------------------------------------------- CPUs


class CoreMeter:
    """Busy share of two CPUs over a phase, from /proc/stat."""

    def __init__(self, front: int, engine: int) -> None:
        self.cpus = {"front": front, "engine": engine}

    @staticmethod
    def _times() -> dict[int, tuple[float, float]]:
        out = {}
        for line in Path("/proc/stat").read_text().splitlines():
            name, *values = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                v = list(map(float, values))
                idle = v[3] + v[4]
                out[int(name[3:])] = (sum(v[:8]) - idle, sum(v[:8]))
        return out

    def start(self) -> dict[int, tuple[float, float]]:
        return self._times()

    def busy(self, start: dict[int, tuple[float, float]]) -> dict[str, float]:
        end = self._times()
        return {role: (end[c][0] - start[c][0]) / max(end[c][1] - start[c][1], 1e-9) for role, c in self.cpus.items()}


def thread_affinities(pid: int) -> set[frozenset[int]]:
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found.add(frozenset(os.sched_getaffinity(int(task.name))))
        except OSError:
            continue
    return found


def pin_all_threads(pid: int, cpus: set[int]) -> None:
    """`sched_setaffinity` of a pid moves one thread; this moves every thread the process has."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except OSError:
            continue


def check_pinning(meter: fb.ProcessMeter, front: int, engine: int) -> list[str]:
    """Every thread of every process on its role's core: what is not."""
    wrong = []
    for proc, role, label in meter.processes():
        want = frozenset({front}) if role == FRONT else frozenset({engine})
        try:
            affinities = thread_affinities(proc.pid)
        except OSError:
            continue
        if affinities - {want}:
            wrong.append(f"{label} (pid {proc.pid}, {role}): threads on {sorted(map(sorted, affinities))}, not [{sorted(want)}]")
    return wrong


# ----------------------------------------------------------------------------- requests


def text_body(max_tokens: int) -> bytes:
    # ≈128 prompt tokens with the chat template (the tiny model's byte-level BPE on plain English).
    words = ("the river the bridge the market and the tower in the morning light " * 12).split()[:96]
    return json.dumps({
        "model": MODEL_NAME, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
        "ignore_eos": True, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Describe it: " + " ".join(words)}],
    }).encode()


def image_body(uri: str, max_tokens: int) -> bytes:
    return json.dumps({
        **ic.chat_body([uri]), "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
        "ignore_eos": True, "max_tokens": max_tokens,
    }).encode()


class Bodies:
    """Each workload's request bodies; new images are never sent twice in the whole bench."""

    def __init__(self, quick: bool) -> None:
        self._maker = ic.ImageMaker(*fb.IMAGE_SIZE)
        self._seed = 0
        self._pool = 400 if quick else 3000
        self.text = [text_body(256)]
        self.repeated = [image_body(self._maker.uri(10**6), 16)]
        self._images: list[bytes] = []

    def new_images(self, n: int) -> list[bytes]:
        while len(self._images) < n:
            self._seed += 1
            self._images.append(image_body(self._maker.uri(self._seed), 16))
        taken, self._images = self._images[:n], self._images[n:]
        return taken

    def for_workload(self, name: str, expected: int) -> list[bytes]:
        if name == "text":
            return self.text
        if name == "repeated image":
            return self.repeated
        return self.new_images(max(expected, 16))


# ----------------------------------------------------------------------------- phases


def run_phase(meter: fb.ProcessMeter, cores: CoreMeter, workload: Workload, kind: str,
              load: Callable[[], tuple[list[sse_client.Answer], float]]) -> Phase:
    start = cores.start()
    (answers, wall_s), cpu = meter.measure(load)
    busy = cores.busy(start)
    good = [a for a in answers if a.ok and a.completion_tokens == workload.max_tokens]
    bad = [a for a in answers if a not in good]
    examples = [a.error or f"status {a.status}, {a.completion_tokens} tokens" for a in bad[:3]]
    ttft = sorted(a.ttft for a in good)
    tpot = sorted(t for a in good if (t := a.tpot) is not None)
    q = lambda values, p: values[min(len(values) - 1, int(p * len(values)))] * 1e3 if values else float("nan")  # noqa: E731
    phase = Phase(workload.name, kind, len(good), len(bad), examples, wall_s, sum(a.completion_tokens or 0 for a in good),
                  {"p50": q(ttft, .5), "p99": q(ttft, .99)}, {"p50": q(tpot, .5), "p99": q(tpot, .99)}, busy, cpu.seconds,
                  med([a.prompt_tokens for a in good if a.prompt_tokens]))
    print(f"    {workload.name:<15} {kind:<14} {phase.ok:5d} ok {phase.failed:3d} failed  {phase.rps:7.1f} req/s "
          f"{phase.output_tokens / wall_s:8.0f} tok/s  TTFT p50 {phase.ttft_ms['p50']:7.1f} p99 {phase.ttft_ms['p99']:7.1f} ms  "
          f"TPOT p50 {phase.tpot_ms['p50']:5.2f} ms  front core {busy['front']:.2f} busy, engine core {busy['engine']:.2f}"
          f"{'  VOID' if phase.void else ''}" + (f"  e.g. {examples[0]}" if examples else ""), flush=True)
    return phase


def capacity_ramp(url: str, meter: fb.ProcessMeter, cores: CoreMeter, bodies: Bodies, seconds: float, quick: bool) -> list[Phase]:
    phases = []
    for w in WORKLOADS:
        for c in (w.ramp[:3] if quick else w.ramp):
            payloads = bodies.for_workload(w.name, int(c * seconds * 12))
            phases.append(run_phase(meter, cores, w, f"closed c={c}",
                                    lambda: asyncio.run(sse_client.closed_loop(url, payloads, c, seconds))))
    return phases


def latency_loads(url: str, meter: fb.ProcessMeter, cores: CoreMeter, bodies: Bodies, seconds: float,
                  rates: dict[str, float], run: int) -> list[Phase]:
    phases = []
    for w in WORKLOADS:
        for share in LATENCY_LOADS:
            rate = rates[w.name] * share
            payloads = bodies.for_workload(w.name, int(rate * seconds * 1.5) + 16)
            phases.append(run_phase(meter, cores, w, f"poisson {share:.0%}",
                                    lambda: asyncio.run(sse_client.poisson(url, payloads, rate, seconds, seed=run))))
    return phases


# ----------------------------------------------------------------------------- the two front ends


def stand_in_command(port: int, model_dir: Path) -> list[str]:
    options = AppConfig().builtin_engine
    return [sys.executable, "-m", "mmserve.builtin_engine", "--handshake", f"tcp://127.0.0.1:{port}",
            "--model-dir", str(model_dir), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(options.max_num_seqs),
            "--step-interval-ms", str(options.step_interval_ms), "--step-us-per-sequence", str(options.step_us_per_sequence),
            "--step-us-per-prefill-token", str(options.step_us_per_prefill_token), "--log-level", "WARNING"]


class System:
    """One front end and its stand-in, started pinned, stopped with everything they started."""

    def __init__(self, name: str, model_dir: Path, work: Path, args: argparse.Namespace, env: dict[str, str], port: int) -> None:
        self.name, self.model_dir, self.work, self.args, self.env, self.port = name, model_dir, work, args, env, port
        self.front_cpus, self.engine_cpus = frozenset({args.front_cpu}), frozenset({args.engine_cpu})

    def __enter__(self) -> System:
        hs_port = free_tcp_port()
        with fb.forking_on(self.engine_cpus):
            log = (self.work / f"stand_in_{self.name}.log").open("ab")
            self.stand_in = subprocess.Popen(stand_in_command(hs_port, self.model_dir), stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
        bench_pid = os.getpid()
        if self.name == "vllm":
            with fb.forking_on(self.front_cpus):
                self.server = VllmApiServer(
                    self.model_dir, served_model_name=MODEL_NAME, max_model_len=MAX_MODEL_LEN, as_users_run=True,
                    log_path=self.work / "vllm_api_server.log",
                    extra_args=["--data-parallel-size-local", "0", "--data-parallel-address", "127.0.0.1",
                                "--data-parallel-rpc-port", str(hs_port), "--api-server-count", str(self.args.api_server_count)],
                ).start()
            self.base_url = self.server.base_url

            def front(proc: psutil.Process) -> bool:
                return self.server.pid in fb.ancestors(proc)

            def dead() -> str | None:
                return None if self.server.is_alive() else f"vLLM's API server exited:\n{self.server.log_tail()}"
        else:
            self.serve = fb.ServeRun([f"model={self.model_dir}", f"served_model_name={MODEL_NAME}",
                                      f"engines=tcp://127.0.0.1:{hs_port}", *fb.SERVE_ARGS_EXTRA],
                                     self.env, self.port, self.work / "serve_run.log")
            with fb.forking_on(self.front_cpus):
                self.serve.start()
            self.base_url = self.serve.base_url
            front = self.serve.owns

            def dead() -> str | None:
                return self.serve.dead()

        def member(proc: psutil.Process) -> str | None:
            if proc.pid == bench_pid:
                return CLIENT
            if self.stand_in.pid in fb.ancestors(proc):
                return ENGINE
            return FRONT if front(proc) else None

        def label(proc: psutil.Process, role: str) -> str:
            if role == FRONT:
                return "vLLM API server" if self.name == "vllm" else self.serve.label(proc)
            return "built-in engine" if role == ENGINE else "bench client"

        self.meter = fb.ProcessMeter(member, label)

        def either_dead() -> str | None:
            if self.stand_in.poll() is not None:
                return f"the stand-in exited {self.stand_in.returncode}"
            return dead()

        fb.wait_ready(self.base_url, 900, either_dead)
        warm = [text_body(16), image_body(ic.ImageMaker(64, 48).uri(1), 4)]
        answers, _ = asyncio.run(sse_client.closed_loop(self.base_url + "/v1/chat/completions", warm, 2, 3.0))
        if not any(a.ok for a in answers):
            raise RuntimeError(f"{self.name}: the warm-up failed: {[a.error for a in answers[:3]]}")
        if wrong := check_pinning(self.meter, self.args.front_cpu, self.args.engine_cpu):
            raise RuntimeError(f"{self.name}: not pinned as the bench requires:\n" + "\n".join(wrong))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.name == "vllm":
            self.server.stop()
        else:
            self.serve.stop(self.meter)
        self.stand_in.terminate()
        try:
            self.stand_in.wait(20)
        except subprocess.TimeoutExpired:
            self.stand_in.kill()


# ----------------------------------------------------------------------------- report


def med(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def report(runs: list[SystemRun], meta: dict[str, Any], rates: dict[str, float]) -> str:
    systems = [s for s in SYSTEMS if any(r.system == s for r in runs)]
    lines = [f"## Capacity per front-end core: mmserve against vLLM's API server ({meta['date']})", "",
             f"Command: `{meta['command']}` ({meta['runs']} runs, {meta['duration_s'] / 60:.1f} min).",
             meta["machine"],  # machine, commit and venvs, one line each
             f"Stand-in: `{meta['stand_in']}` on CPU {meta['engine_cpu']}, with the client; each front end alone on CPU "
             f"{meta['front_cpu']}. mmserve: `{meta['serve_command']}`. vLLM: `{meta['vllm_command']}`.", "",
             "### Capacity (closed loop, the best level of the ramp; medians over runs)", "",
             "| workload | req/s per front-end core, " + " · ".join(systems) + " | ratio | req/s, " + " · ".join(systems)
             + " | front core busy | output tok/s | front-end CPU ms/request | at concurrency | void levels |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for w in WORKLOADS:
        caps = {s: [c for r in runs if r.system == s and r.part == "capacity" and (c := r.capacity(w.name))] for s in systems}
        per_core = {s: med([c.rps_per_front_core for c in caps[s]]) for s in systems}
        tok = {s: med([c.output_tokens / c.wall_s for c in caps[s]]) for s in systems}
        rps = {s: med([c.rps for c in caps[s]]) for s in systems}
        busy = {s: med([c.cpu_busy["front"] for c in caps[s]]) for s in systems}
        bound = {s: "" if busy[s] >= FRONT_BOUND_BUSY else " (not front-bound)" for s in systems}
        cpu = {s: med([c.ms_per_request(FRONT) for c in caps[s]]) for s in systems}
        at = {s: "/".join(c.kind.split("=")[1] for c in caps[s]) for s in systems}
        void = sum(p.void for r in runs if r.part == "capacity" for p in r.phases if p.workload == w.name)
        ratio = per_core.get("mmserve", float("nan")) / per_core.get("vllm", float("nan")) if len(systems) == 2 else float("nan")
        lines.append(f"| {w.name} | " + " · ".join(f"{per_core[s]:.1f}{bound[s]}" for s in systems) + f" | **{ratio:.2f}×** | "
                     + " · ".join(f"{rps[s]:.1f}" for s in systems) + " | " + " · ".join(f"{busy[s]:.2f}" for s in systems) + " | "
                     + " · ".join(f"{tok[s]:.0f}" for s in systems) + " | " + " · ".join(f"{cpu[s]:.2f}" for s in systems)
                     + " | " + " · ".join(at[s] for s in systems) + f" | {void} |")
    lines += ["", "### Latency under load (open loop, Poisson; rates from the lower capacity; medians over runs)", "",
              "| workload | load | rate req/s | TTFT p50 ms, " + " · ".join(systems) + " | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | failed |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for w in WORKLOADS:
        for share in LATENCY_LOADS:
            kind = f"poisson {share:.0%}"
            ph = {s: [p for r in runs if r.system == s and r.part == "latency" for p in r.phases if p.workload == w.name and p.kind == kind]
                  for s in systems}
            cell = lambda metric, pct: " · ".join(f"{med([getattr(p, metric)[pct] for p in ph[s]]):.1f}" for s in systems)  # noqa: E731
            failed = " · ".join(str(sum(p.failed for p in ph[s])) for s in systems)
            lines.append(f"| {w.name} | {share:.0%} | {rates.get(w.name, float('nan')) * share:.1f} | {cell('ttft_ms', 'p50')} | "
                         f"{cell('ttft_ms', 'p99')} | {cell('tpot_ms', 'p50')} | {cell('tpot_ms', 'p99')} | {failed} |")
    lines += ["", "### Front-end CPU per request at capacity, by process (ms, medians over runs)", ""]
    for s in systems:
        for w in WORKLOADS:
            caps = [c for r in runs if r.system == s and r.part == "capacity" and (c := r.capacity(w.name))]
            labels = sorted({label for c in caps for label in c.cpu_s.get(FRONT, {})})
            by = {label: med([c.cpu_s.get(FRONT, {}).get(label, 0.0) / c.ok * 1e3 for c in caps]) for label in labels}
            top = ", ".join(f"{label} {v:.2f}" for label, v in sorted(by.items(), key=lambda kv: -kv[1]) if v >= 0.01)
            stand_in = med([c.ms_per_request(ENGINE) for c in caps])
            lines.append(f"- {s}, {w.name}: {top}; stand-in {stand_in:.2f}, engine core busy "
                         f"{med([c.cpu_busy['engine'] for c in caps]):.2f}")
    lines += ["", "### Every phase", "", "| run | system | part | workload | phase | ok | failed | req/s | front core busy | "
              "engine core busy | TTFT p50 / p99 ms | TPOT p50 ms | prompt tokens |", "|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        for p in r.phases:
            lines.append(f"| {r.run} | {r.system} | {r.part} | {p.workload} | {p.kind}{' (void)' if p.void else ''} | {p.ok} | "
                         f"{p.failed} | {p.rps:.1f} | {p.cpu_busy['front']:.2f} | {p.cpu_busy['engine']:.2f} | "
                         f"{p.ttft_ms['p50']:.1f} / {p.ttft_ms['p99']:.1f} | {p.tpot_ms['p50']:.2f} | {p.prompt_tokens:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: three ramp levels, short phases")
    parser.add_argument("--out", default=str(fb.REPO / "bench" / "results" / "capacity.md"))
    parser.add_argument("--front-cpu", type=int, default=0)
    parser.add_argument("--engine-cpu", type=int, default=1)
    parser.add_argument("--systems", default="vllm,mmserve")
    parser.add_argument("--api-server-count", type=int, default=1, help="vLLM's API server processes (all on the front-end core)")
    parser.add_argument("--seconds", type=float, help="per phase (default 12, --quick 4)")
    args = parser.parse_args()
    systems = args.systems.split(",")
    if set(systems) - set(SYSTEMS) or {args.front_cpu, args.engine_cpu} - os.sched_getaffinity(0) or args.front_cpu == args.engine_cpu:
        parser.error("--systems of vllm, mmserve; two different CPUs this process may use")
    seconds = args.seconds or (4.0 if args.quick else 12.0)
    pin_all_threads(os.getpid(), {args.engine_cpu})  # the client, beside the stand-in
    _, readme_env, port = fb.readme_quick_start()
    env = fb.serve_environment(readme_env, {})
    out = Path(args.out)
    started = time.monotonic()
    meta: dict[str, Any] = {
        "command": " ".join([".venv/bin/python bench/capacity_bench.py", *map(shlex.quote, sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"), "runs": args.runs, "machine": fb.machine_facts(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=fb.REPO, capture_output=True, text=True).stdout.strip(),
        "front_cpu": args.front_cpu, "engine_cpu": args.engine_cpu,
        "stand_in": " ".join(stand_in_command(0, Path("MODEL")))[len(sys.executable) + 1:].replace("tcp://127.0.0.1:0", "tcp://…"),
        "serve_command": " ".join(f"{k}={v}" for k, v in readme_env.items()) + " serve run serve_app:build_app model=MODEL engines=tcp://…",
        "vllm_command": f"vllm serve MODEL --data-parallel-size-local 0 --data-parallel-address 127.0.0.1 --data-parallel-rpc-port … "
                        f"--api-server-count {args.api_server_count}",
    }
    runs: list[SystemRun] = []
    rates: dict[str, float] = {}
    bodies = Bodies(args.quick)

    def save() -> None:
        meta["duration_s"] = time.monotonic() - started
        out.with_suffix(".json").write_text(json.dumps({**meta, "rates": rates, "runs": [asdict(r) for r in runs]}, indent=1))

    with tempfile.TemporaryDirectory(prefix="capacity_bench_") as tmp:
        work = Path(tmp)
        model_dir = build_tiny_qwen2_vl(work / MODEL_NAME, seed=0)
        order = lambda run: systems if run % 2 else systems[::-1]  # noqa: E731

        def each_run(part: str, measure: Callable[[Any, int], list]) -> None:
            """`measure(system, run)` for every run and system, in the run's order."""
            for run in range(1, args.runs + 1):
                for name in order(run):
                    print(f"== run {run}, {part}: {name}", flush=True)
                    with System(name, model_dir, work, args, env, port) as system:
                        runs.append(SystemRun(name, run, part, measure(system, run)))
                    save()

        chat = "/v1/chat/completions"
        cores = lambda: CoreMeter(args.front_cpu, args.engine_cpu)  # noqa: E731
        each_run("capacity", lambda system, run: capacity_ramp(
            system.base_url + chat, system.meter, cores(), bodies, seconds, args.quick))
        for w in WORKLOADS:
            rates[w.name] = min(med([c.rps for r in runs if r.system == s and (c := r.capacity(w.name))]) for s in systems)
        print(f"latency loads from the lower capacity: {rates}", flush=True)
        each_run("latency", lambda system, run: latency_loads(
            system.base_url + chat, system.meter, cores(), bodies, seconds, rates, run))
    save()
    text = report(runs, meta, rates)
    out.write_text(text)
    print("\n" + text + f"\nwrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()

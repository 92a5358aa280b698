"""The gateway's front-end cost, side by side with vLLM's own API server (issue 16, step 1).

    .venv/bin/python bench/frontend_bench.py [--runs 3] [--quick] [--out bench/results/frontend.md]
        [--label NAME] [--setups vllm,mmserve] [--serve-env KEY=VALUE ...] [--mmserve-engine launched|headless]
        [--client-group-nice N] [--engine-cpus LIST]

Two systems in front of the same engine (tiny random Qwen2-VL built once, `tests/support/tiny_models.py`;
the engine flags of `tests/support/vllm_engines.py`, max_model_len of `bench/image_chat_bench.py`), one
after the other, never at the same time. Each run starts both afresh, in this order:

- **vLLM**: `vllm serve` (`VllmApiServer`), its own OpenAI server; its main process is the front end,
  its children (EngineCore, worker) are the engine.
- **mmserve**: started exactly as README tells users: `.venv/bin/serve run serve_app:build_app model=…
  served_model_name=… engines=tcp://127.0.0.1:PORT handshake_timeout_s=600 health_check_timeout_s=30`
  from the repository root, with the Ray instance's settings README's quick start gives it
  (`cluster/ray.env`; `--serve-env` adds or overrides) and no other `RAY_*` variable, on README's HTTP
  port. Its engine is the same `vllm serve --headless` with the same flags
  and environment, launched by the application (`engine_launch=…`: its launcher actor's child, in Ray's
  session), README's usual way. With `--mmserve-engine headless` (the default before 2026-12-06), the
  engine (`HeadlessVllmEngine`) is started beside `serve run` instead, in a session of its own, and
  connects to it (`engines=tcp://…`). The difference matters on a shared node: Linux's autogroup
  schedules each session as one group; vLLM's API server shares its engine's, a launched engine shares
  the gateway's, and a headless engine's group starves the gateway (`bench/RESULTS.md` §0, "scheduling
  groups"). Stopped with SIGINT to `serve run`; whatever of its processes outlives that is killed.

Per system and run: wait until `/health` is 200 and a chat succeeds, warm up (text and image chats),
measure idle CPU, then the workloads: streamed chat completions (`stream_options.include_usage`,
temperature 0, `ignore_eos`), closed loop, identical request bodies for both systems, each workload
bounded by a request count and a time cap (no new request after it; the ones in flight finish):

- text c=1 and c=32, 64 tokens out;
- image c=1 and c=8, 8 tokens out, one 640×480 JPEG data URI per request, distinct across the whole
  run (no cache can help; the same images in the same order for both systems);
- repeated image c=8, 8 tokens out, the same image in every request.

Metrics: req/s (requests answered in full / wall time until the last one ended), TTFT (first chunk
carrying content, not the role chunk), time per output token ((last chunk − first chunk) / (tokens − 1),
per request), and CPU seconds per request, by process: psutil user + system time snapshots before
and after each phase, sampled every second in between so that a process which exits mid-phase keeps its
last reading. Processes are classified by role:

- engine: the `vllm serve` (vLLM: its children; mmserve: the headless engine's whole tree);
- gateway: vLLM's API server process; for mmserve every process under `serve run` (Ray's GCS, raylet,
  dashboard, agents, monitors, workers: Serve controller, proxy, HAProxy, the replicas, and the driver),
  plus Ray processes outside that tree that belong to its Ray instance (session name in the command
  line, or `RAY_RAYLET_PID` of its raylet in the environment); they are flagged in the process list;
- client: this process (load generator and meter), reported apart, never part of the gateway.

A request fails when its status is not 200, its stream carries an error or no content, or its usage
does not report the requested token count; failures are counted and shown, and excluded from the
latency statistics. "Other load" is the machine's busy CPU minus all of the above: other jobs.

The client's scheduling group runs at niceness -10 (`--client-group-nice`; `/proc/self/autogroup`, the
group of this process's session, whose old niceness is restored at the end): Linux's autogroup schedules
each session as one group, both systems run in sessions of their own, and a client in a group of equal
weight waited up to 170 ms for a core during a 200-ms answer, receiving a streamed answer whole at its
end (`bench/stream_delivery_probe.py`, 2026-12-06): its TTFT then measured the client. A real client
runs on a machine of its own.

With `--engine-cpus 1` the machine is split in two as a deployment that moves the front end off the
engine's node would be (`EngineNode`): each system's engine alone on those CPUs, each system's front end
and the client on the others. vLLM then runs as two processes, its engine (`vllm serve --headless`, the
same flags) on the engine's CPUs and its API server with no engine of its own (`--data-parallel-size-local
0`, connected to that engine) on the front end's, as mmserve's gateway is: both front ends get the same
cores. CPU per request is measured the same way; requests/s and latencies then say what the engine's node
serves with its front end elsewhere.

Writes the markdown report (medians over runs; ratios mmserve ÷ vLLM of the medians) and, beside it,
the per-run numbers as JSON (rewritten after every run). Not a test: nothing is asserted about timings.
Everything shares the machine's cores with the client; run it with nothing else on the machine.
On 2 cores the default 3 runs take ≈ 18 min, `--quick --runs 1` ≈ 3.5 min.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Callable, Literal, TypeVar

# The environment this bench was started with, before gateway_bench's defaults are added to it.
START_ENV = dict(os.environ)

# Started in the background (`cmd &` in a script), this process inherits SIGINT ignored, and so
# would `serve run`, which stops on SIGINT: a handler here makes it the default again in children.
signal.signal(signal.SIGINT, signal.default_int_handler)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gateway_bench as gb  # noqa: E402  (puts the repository on sys.path)
import image_chat_bench as ic  # noqa: E402

import httpx  # noqa: E402
import psutil  # noqa: E402

from tests.support.reference_venv import reference_python, reference_vllm_version  # noqa: E402
from tests.support.serve_process import ray_instance_settings  # noqa: E402
from tests.support.tiny_models import build_tiny_qwen2_vl  # noqa: E402
from tests.support.vllm_engines import HeadlessVllmEngine, VllmApiServer, free_tcp_port  # noqa: E402
from tests.support.vllm_reference import VLLM_CPU_ENV  # noqa: E402

REPO = gb.REPO
MODEL_NAME = gb.MODEL_NAME
MAX_MODEL_LEN = ic.MAX_MODEL_LEN
IMAGE_SIZE = (640, 480)
GATEWAY_VENV_BIN = REPO / ".venv" / "bin"
SYSTEMS = {"vllm": "vLLM", "mmserve": "mmserve"}
GATEWAY, ENGINE, CLIENT = "gateway", "engine", "client"
VLLM_API_SERVER = "vLLM API server"
# The arguments README's "Pointing it at real vLLM engines" shows, plus two generous timeouts
# (the engine compiles and loads for a while on 2 cores; a loaded machine may answer slowly).
SERVE_ARGS_EXTRA = ["handshake_timeout_s=600", "health_check_timeout_s=30"]
T = TypeVar("T")


@dataclass(frozen=True)
class Workload:
    name: str
    kind: Literal["text", "image", "repeated image"]  # image: a distinct image per request
    concurrency: int
    max_tokens: int
    requests: int  # the most requests of a full run (--quick: a quarter)


WORKLOADS = [
    Workload("text c=1", "text", 1, 64, 60),
    Workload("text c=32", "text", 32, 64, 480),
    Workload("image c=1", "image", 1, 8, 150),
    Workload("image c=8", "image", 8, 8, 300),
    Workload("repeated image c=8", "repeated image", 8, 8, 300),
]


@dataclass(frozen=True)
class Timing:
    workload_s: float  # no new request after this
    idle_s: float
    warmup_text: int
    warmup_images: int


# ----------------------------------------------------------------------------- an engine node of its own (--engine-cpus)


@dataclass(frozen=True)
class EngineNode:
    """One machine split in two: the engine's node (`engine_cpus`: each system's engine alone) and the rest
    (`front_cpus`: each system's front end, vLLM's API server or mmserve's gateway, and the bench client)."""

    engine_cpus: frozenset[int]
    front_cpus: frozenset[int]

    @classmethod
    def parse(cls, cpu_list: str) -> EngineNode:
        """`1` or `2-3` or `1,3`: the engine's CPUs; the front end gets the others this process may use."""
        engine: set[int] = set()
        for part in cpu_list.split(","):
            low, _, high = part.partition("-")
            engine.update(range(int(low), int(high or low) + 1))
        allowed = os.sched_getaffinity(0)
        if not engine or not engine < allowed:
            raise ValueError(f"--engine-cpus {cpu_list!r} must name some, not all, of this process's CPUs {sorted(allowed)}")
        return cls(frozenset(engine), frozenset(allowed - engine))

    @property
    def taskset(self) -> list[str]:
        """The command prefix that runs a program on the engine's CPUs (for an engine the app launches)."""
        return ["taskset", "--cpu-list", ",".join(map(str, sorted(self.engine_cpus)))]

    def describe(self) -> str:
        return (f"an engine node of its own: each engine alone on CPUs {sorted(self.engine_cpus)}; each front end (vLLM's "
                f"API server, mmserve's gateway) and the bench client on CPUs {sorted(self.front_cpus)}")


@contextlib.contextmanager
def forking_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Processes this thread starts in the block run on `cpus` (a child inherits the affinity of the
    thread that forks it, and so do its own children); None: as before."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)  # this thread's (pid 0: the calling thread)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


FULL = Timing(workload_s=15.0, idle_s=20.0, warmup_text=16, warmup_images=8)
QUICK = Timing(workload_s=4.0, idle_s=5.0, warmup_text=4, warmup_images=2)


# ----------------------------------------------------------------------------- CPU by process


@dataclass
class CpuUse:
    """CPU seconds (user + system) over one phase, by role and process label."""

    wall_s: float
    machine_busy_s: float
    seconds: dict[str, dict[str, float]]  # role -> label -> CPU seconds
    processes: dict[str, dict[str, int]]  # role -> label -> processes seen

    def role_s(self, role: str) -> float:
        return sum(self.seconds.get(role, {}).values())

    @property
    def other_cores(self) -> float:
        ours = sum(self.role_s(role) for role in self.seconds)
        return max(0.0, self.machine_busy_s - ours) / self.wall_s


class ProcessMeter:
    """Measures the CPU of one system's processes. `member(proc)` names a process's role (None: not part
    of the system), decided once per process; `label(proc, role)` names it on every reading (a Ray
    worker's title changes when it becomes an actor)."""

    def __init__(self, member: Callable[[psutil.Process], str | None], label: Callable[[psutil.Process, str], str],
                 interval_s: float = 1.0) -> None:
        self._member, self._label, self._interval_s = member, label, interval_s
        self._roles: dict[tuple[int, float], str | None] = {}

    def readings(self) -> dict[tuple[int, float], tuple[str, str, float]]:
        """(pid, create time) -> (role, label, CPU seconds) of every process of the system."""
        out = {}
        for proc in psutil.process_iter():
            try:
                key = (proc.pid, proc.create_time())
                if key not in self._roles:
                    self._roles[key] = self._member(proc)
                role = self._roles[key]
                if role is None:
                    continue
                times = proc.cpu_times()
                out[key] = (role, self._label(proc, role), times.user + times.system)
            except psutil.Error:
                continue
        return out

    def processes(self) -> list[tuple[psutil.Process, str, str]]:
        """The system's live processes with their role and label."""
        found = []
        for (pid, _), (role, label, _) in self.readings().items():
            try:
                found.append((psutil.Process(pid), role, label))
            except psutil.Error:
                pass
        return found

    @staticmethod
    def _machine_busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def measure(self, work: Callable[[], T]) -> tuple[T, CpuUse]:
        """Runs `work()` and returns its result and the CPU the system used meanwhile."""
        start = self.readings()
        busy0, t0 = self._machine_busy(), time.monotonic()
        latest = dict(start)
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(self._interval_s):
                latest.update(self.readings())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            result = work()
        finally:
            stop.set()
            sampler.join()
        latest.update(self.readings())
        wall_s, busy_s = time.monotonic() - t0, self._machine_busy() - busy0
        seconds: dict[str, dict[str, float]] = {}
        processes: dict[str, dict[str, int]] = {}
        for key, (role, label, cpu) in latest.items():
            before = start.get(key, (role, label, 0.0))[2]
            cpu_by_label, count_by_label = seconds.setdefault(role, {}), processes.setdefault(role, {})
            cpu_by_label[label] = cpu_by_label.get(label, 0.0) + max(0.0, cpu - before)
            count_by_label[label] = count_by_label.get(label, 0) + 1
        return result, CpuUse(wall_s, busy_s, seconds, processes)


def ancestors(proc: psutil.Process) -> set[int]:
    return {proc.pid, *(p.pid for p in proc.parents())}


def cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def engine_label(proc: psutil.Process, root: int) -> str:
    """`vllm serve` for the engine's (or server's) own process, else its process title (VLLM::EngineCore…)."""
    if proc.pid == root:
        return "vllm serve"
    cmd = cmdline(proc)
    return cmd.split(" ", 1)[0] if cmd.startswith("VLLM::") else other_label(cmd)


def other_label(cmd: str) -> str:
    if "multiprocessing.resource_tracker" in cmd:
        return "multiprocessing resource tracker"
    return f"other ({Path(cmd.split(' ', 1)[0]).name})"


# Ray's processes by command line, first match wins ("ray::" titles are handled before).
RAY_DAEMONS = [
    ("gcs_server", "GCS server"),
    ("/raylet/raylet", "raylet"),
    ("dashboard/agent.py", "dashboard agent"),
    ("runtime_env/agent/main.py", "runtime-env agent"),
    ("dashboard/dashboard.py", "dashboard"),
    ("ray-dashboard-", "dashboard modules"),  # "ray-dashboard-ServeHead-0 (…forkserver…)"
    ("ray.dashboard.subprocesses", "dashboard modules"),  # their multiprocessing forkserver
    ("log_monitor.py", "log monitor"),
    ("autoscaler/_private/monitor.py", "autoscaler monitor"),
    ("default_worker.py", "Ray worker (starting)"),
]
RAY_ACTORS = {
    "ProxyActor": "Serve proxy",
    "ServeController": "Serve controller",
    "IDLE": "idle Ray workers",
    "DashboardAgent": "dashboard agent",
    "RuntimeEnvAgent": "runtime-env agent",
    "HAProxyManager": "HAProxy manager",
}


def gateway_label(cmd: str) -> str:
    """The label of one of `serve run`'s processes (the driver is labelled by the caller)."""
    first = cmd.split(" ", 1)[0]
    if first.startswith("ray::"):
        # "ray::ServeReplica:default:Ingress", "ray::ProxyActor", "ray::IDLE", possibly with ".method".
        title = first[len("ray::"):]
        if title.startswith("ServeReplica:"):
            return title.split(":")[-1].split(".")[0] + " replica"
        name = title.split(".")[0]
        return RAY_ACTORS.get(name, f"Ray worker {name}")
    if "haproxy" in Path(first).name:
        return "HAProxy"
    for needle, label in RAY_DAEMONS:
        if needle in cmd:
            return label
    return other_label(cmd)


# ----------------------------------------------------------------------------- requests


def make_bodies(quick: bool) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    """Each workload's request bodies (distinct images across all of them) and the warm-up's."""
    timing = QUICK if quick else FULL
    maker = ic.ImageMaker(*IMAGE_SIZE)
    seeds = iter(range(1, 10**9))
    t0 = time.monotonic()
    bodies: dict[str, list[dict[str, Any]]] = {}
    for w in WORKLOADS:
        n = max(w.requests // 4, 2 * w.concurrency) if quick else w.requests
        if w.kind == "text":
            bodies[w.name] = [gb.chat_body(MODEL_NAME, w.max_tokens, token_ids=False)] * n
        elif w.kind == "image":
            bodies[w.name] = [image_body(maker.uri(next(seeds)), w.max_tokens) for _ in range(n)]
        else:
            bodies[w.name] = [image_body(maker.uri(next(seeds)), w.max_tokens)] * n
    warm = [gb.chat_body(MODEL_NAME, 64, token_ids=False)] * timing.warmup_text
    warm += [image_body(maker.uri(next(seeds)), 8) for _ in range(timing.warmup_images)]
    print(f"made the request bodies in {time.monotonic() - t0:.1f} s", flush=True)
    return bodies, warm


def image_body(uri: str, max_tokens: int) -> dict[str, Any]:
    return {**ic.chat_body([uri]), "max_tokens": max_tokens}


def check_streams(streams: list[gb.Stream], max_tokens: int) -> tuple[list[gb.Stream], list[str]]:
    """Answered streams whose usage reports the requested token count, and why the others failed."""
    good, failures = [], []
    for s in streams:
        if s.completion_tokens == max_tokens:
            good.append(s)
        else:
            failures.append(f"usage reported {s.completion_tokens} completion tokens, expected {max_tokens}")
    return good, failures


# ----------------------------------------------------------------------------- one system


@dataclass
class WorkloadRun:
    workload: str
    ok: int
    failed: int
    failure_examples: list[str]
    elapsed_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    latency_p50_ms: float  # request sent → last content chunk
    prompt_tokens: list[int]
    cpu: CpuUse

    @property
    def rps(self) -> float:
        return self.ok / self.elapsed_s if self.elapsed_s else 0.0

    def ms_per_request(self, role: str, label: str | None = None) -> float:
        if not self.ok:
            return float("nan")
        seconds = self.cpu.role_s(role) if label is None else self.cpu.seconds.get(role, {}).get(label, 0.0)
        return seconds / self.ok * 1e3

    def ms_per_request_less_idle(self, role: str, idle_cores: float) -> float:
        """CPU ms per request beyond what the role burns doing nothing (`idle_cores` over this phase's wall time)."""
        if not self.ok:
            return float("nan")
        return (self.cpu.role_s(role) - idle_cores * self.cpu.wall_s) / self.ok * 1e3


@dataclass
class SystemRun:
    system: str
    run: int
    ready_s: float  # start until healthy and answering
    idle: CpuUse | None = None
    workloads: list[WorkloadRun] = field(default_factory=list)
    process_list: list[str] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)

    def workload(self, name: str) -> WorkloadRun | None:
        return next((w for w in self.workloads if w.workload == name), None)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SystemRun:
        """The inverse of `asdict`, for a report rebuilt from a saved JSON (`--report-from`)."""
        workloads = [WorkloadRun(**{**w, "cpu": CpuUse(**w["cpu"])}) for w in d["workloads"]]
        idle = CpuUse(**d["idle"]) if d.get("idle") else None
        return cls(**{**d, "idle": idle, "workloads": workloads})


def run_workload(url: str, w: Workload, bodies: list[dict[str, Any]], meter: ProcessMeter, max_s: float) -> WorkloadRun:
    (streams, elapsed, transport_failed), cpu = meter.measure(lambda: asyncio.run(ic.closed_loop(url, bodies, w.concurrency, max_s)))
    good, failures = check_streams(streams, w.max_tokens)
    if failures:
        print(f"  !! {len(failures)} request(s) with the wrong token count, e.g. {failures[0]}", flush=True)
    ttft = [s.ttft for s in good]
    tpot = [t for s in good if (t := s.tpot) is not None]
    latency = [s.chunk_times[-1] - s.t_send for s in good]
    r = WorkloadRun(
        w.name, len(good), transport_failed + len(failures), failures[:3], elapsed,
        gb.pct(ttft, .5) * 1e3, gb.pct(ttft, .9) * 1e3, gb.pct(tpot, .5) * 1e3, gb.pct(tpot, .9) * 1e3,
        gb.pct(latency, .5) * 1e3, sorted({s.prompt_tokens for s in good if s.prompt_tokens}), cpu,
    )
    print(f"  {w.name:<19} {r.ok:4d} ok ({r.failed} failed) in {elapsed:5.1f} s: {r.rps:6.2f} req/s, "
          f"TTFT p50 {r.ttft_p50_ms:7.1f} ms, TPOT p50 {r.tpot_p50_ms:6.2f} ms, gateway {r.ms_per_request(GATEWAY):6.1f} ms "
          f"CPU/request, other load {r.cpu.other_cores:.2f} cores", flush=True)
    return r


# The client's scheduling-group niceness (see the module's docstring).
CLIENT_GROUP_NICE = -10


@contextlib.contextmanager
def client_scheduling_group(nice: int) -> Iterator[str]:
    """This process's scheduling group (its session's autogroup) at `nice` while the block runs, then
    back; yields what the group ran at, for the report."""
    path = Path("/proc/self/autogroup")
    if not path.exists():
        yield "no autogroup (the kernel does not schedule sessions as groups)"
        return
    before = int(path.read_text().split("nice")[1])
    try:
        path.write_text(str(nice))
    except OSError as exc:
        print(f"!! could not set the client's scheduling group to nice {nice}: {exc}", flush=True)
    try:
        yield path.read_text().strip()
    finally:
        with contextlib.suppress(OSError):
            path.write_text(str(before))


def wait_ready(base_url: str, timeout_s: float, dead: Callable[[], str | None]) -> None:
    """Until `/health` is 200 and a small chat is answered; `dead()` says why waiting is pointless."""
    deadline = time.monotonic() + timeout_s
    chat = {"model": MODEL_NAME, "messages": gb.MESSAGES, "max_tokens": 4, "temperature": 0.0}
    while time.monotonic() < deadline:
        if (why := dead()) is not None:
            raise RuntimeError(why)
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                r = httpx.post(base_url + "/v1/chat/completions", json=chat, timeout=60)
                if r.status_code == 200 and r.json().get("choices"):
                    return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{base_url} not ready after {timeout_s} s")


def measure_system(system: SystemRun, base_url: str, meter: ProcessMeter, bodies: dict[str, list[dict[str, Any]]],
            warm: list[dict[str, Any]], timing: Timing) -> None:
    url = base_url + "/v1/chat/completions"
    t0 = time.monotonic()
    streams, _, failed = asyncio.run(ic.closed_loop(url, warm, 2, 300))
    print(f"  warm-up: {len(streams)} ok, {failed} failed, {time.monotonic() - t0:.1f} s", flush=True)
    system.process_list = [f"{p.pid} [{role}] {label}: {cmdline(p)[:160]}" for p, role, label in
                           sorted(meter.processes(), key=lambda x: (x[1], x[2], x[0].pid))]
    _, system.idle = meter.measure(lambda: time.sleep(timing.idle_s))
    print(f"  idle: gateway {system.idle.role_s(GATEWAY) / system.idle.wall_s:.3f} cores "
          f"({describe(system.idle.seconds.get(GATEWAY, {}), system.idle.wall_s)})", flush=True)
    for w in WORKLOADS:
        system.workloads.append(run_workload(url, w, bodies[w.name], meter, timing.workload_s))


def describe(seconds: dict[str, float], wall_s: float) -> str:
    return ", ".join(f"{label} {s / wall_s:.3f}" for label, s in sorted(seconds.items(), key=lambda kv: -kv[1]) if s / wall_s >= 0.0005)


def run_vllm(run: int, model_dir: Path, work: Path, bodies: dict[str, list[dict[str, Any]]], warm: list[dict[str, Any]],
             timing: Timing, engine_node: EngineNode | None = None) -> SystemRun:
    """`vllm serve` as users start it; on a split machine its API server on the front end's CPUs (started
    with no engine of its own) and its engine (`--headless`, the same flags) alone on the engine's."""
    print(f"== run {run}: vLLM (`vllm serve`, its own API server)", flush=True)
    t0 = time.monotonic()
    engine = None
    extra: list[str] = []
    if engine_node is not None:
        hs_port = free_tcp_port()
        with forking_on(engine_node.engine_cpus):
            engine = HeadlessVllmEngine(model_dir, hs_port, max_model_len=MAX_MODEL_LEN, log_path=work / f"vllm_engine_{run}.log",
                                        as_users_run=True).start()
        extra = ["--data-parallel-size-local", "0", "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(hs_port)]
    with forking_on(engine_node and engine_node.front_cpus):
        server = VllmApiServer(model_dir, served_model_name=MODEL_NAME, max_model_len=MAX_MODEL_LEN, extra_args=extra,
                               log_path=work / f"vllm_server_{run}.log", as_users_run=True).start()
    bench_pid = os.getpid()

    def member(proc: psutil.Process) -> str | None:
        if proc.pid == bench_pid:
            return CLIENT
        if proc.pid == server.pid:
            return GATEWAY
        lineage = ancestors(proc)
        if engine is not None:
            return ENGINE if engine.pid in lineage else GATEWAY if server.pid in lineage else None
        return ENGINE if server.pid in lineage else None

    def label(proc: psutil.Process, role: str) -> str:
        if role == GATEWAY:
            return VLLM_API_SERVER if proc.pid == server.pid else other_label(cmdline(proc))
        return engine_label(proc, engine.pid if engine is not None else server.pid) if role == ENGINE else "bench client"

    try:
        server.wait_healthy(timeout=900)
        wait_ready(server.base_url, 300, lambda: None if server.is_alive() else f"vllm serve exited:\n{server.log_tail()}")
        system = SystemRun(SYSTEMS["vllm"], run, time.monotonic() - t0)
        measure_system(system, server.base_url, ProcessMeter(member, label), bodies, warm, timing)
        return system
    finally:
        server.stop()
        if engine is not None:
            engine.stop()


# ----------------------------------------------------------------------------- mmserve as README starts it


def readme_quick_start() -> tuple[str, dict[str, str], int]:
    """README's quick-start line that runs `serve run serve_app:app`, the Ray instance's settings it gives
    (`cluster/ray.env`), and the port the quick start serves on."""
    section = (REPO / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    line = next((ln for ln in (block.group(1) if block else "").splitlines() if "serve run serve_app:app" in ln), None)
    if line is None:
        raise RuntimeError("README's quick start has no ```bash line with `serve run serve_app:app`")
    port = re.search(r"http://127\.0\.0\.1:(\d+)", section)
    return line.strip(), ray_instance_settings(), int(port.group(1)) if port else 8000


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class ServeRun:
    """`.venv/bin/serve run serve_app:build_app …` in its own session, from the repository root, and
    the Ray instance it starts."""

    def __init__(self, args: list[str], env: dict[str, str], port: int, log_path: Path) -> None:
        self.argv = [str(GATEWAY_VENV_BIN / "serve"), "run", "serve_app:build_app", *args]
        self.env, self.port, self.log_path = env, port, log_path
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.raylets: set[int] = set()
        self.outside: set[int] = set()  # Ray processes of this instance found outside serve run's tree

    def start(self) -> ServeRun:
        if not port_is_free(self.port):
            raise RuntimeError(f"port {self.port} (README's quick start port) is busy: another server is running; stop it first")
        if Path("/tmp/ray/ray_current_cluster").exists():
            raise RuntimeError("/tmp/ray/ray_current_cluster exists: `serve run` would join that Ray cluster "
                               "(`.venv/bin/ray stop` ends it)")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.session = re.compile(rf"session_[0-9_-]+_{self.proc.pid}\b")
        return self

    def dead(self) -> str | None:
        assert self.proc is not None, "not started"
        if self.proc.poll() is None:
            return None
        return f"`serve run` exited {self.proc.returncode}:\n{self.log_path.read_text(errors='replace')[-4000:]}"

    def owns(self, proc: psutil.Process) -> bool:
        """A process of this `serve run`: its descendant, or a Ray process of its Ray instance."""
        assert self.proc is not None, "not started"
        if self.proc.pid in ancestors(proc):
            if "/raylet/raylet" in cmdline(proc):
                self.raylets.add(proc.pid)
            return True
        try:
            raylet = proc.environ().get("RAY_RAYLET_PID", "")
        except psutil.Error:
            raylet = ""
        if self.session.search(cmdline(proc)) or (raylet.isdigit() and int(raylet) in self.raylets):
            self.outside.add(proc.pid)
            return True
        return False

    def label(self, proc: psutil.Process) -> str:
        assert self.proc is not None, "not started"
        label = "serve run driver" if proc.pid == self.proc.pid else gateway_label(cmdline(proc))
        return label + (" (outside serve run's tree)" if proc.pid in self.outside else "")

    def stop(self, meter: ProcessMeter) -> None:
        """SIGINT to `serve run`; then whatever of its processes is left gets SIGTERM, then SIGKILL."""
        if self.proc is None:
            return
        ours = [p for p, role, _ in meter.processes() if role == GATEWAY]
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            print("  !! serve run did not exit within 90 s of SIGINT", flush=True)
        _, alive = psutil.wait_procs(ours, timeout=20)
        if alive:
            print(f"  !! {len(alive)} process(es) of serve run left 20 s after SIGINT: terminating them", flush=True)
            for p in alive:
                p.terminate()
            _, alive = psutil.wait_procs(alive, timeout=10)
            for p in alive:
                p.kill()
            _, alive = psutil.wait_procs(alive, timeout=10)
        leftovers = [p for p in psutil.process_iter() if self._is_left_over(p)]
        if alive or leftovers:
            print(f"  !! Ray processes left: {[p.pid for p in alive + leftovers]}: `ray stop --force` (ends every Ray instance here)",
                  flush=True)
            subprocess.run([str(GATEWAY_VENV_BIN / "ray"), "stop", "--force"], check=False, capture_output=True, timeout=120)
        deadline = time.monotonic() + 60
        while not port_is_free(self.port) and time.monotonic() < deadline:
            time.sleep(1)

    def _is_left_over(self, proc: psutil.Process) -> bool:
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE and self.owns(proc)
        except psutil.Error:
            return False


@contextlib.contextmanager
def quick_start_serving(env: dict[str, str], port: int, log_path: Path, timeout_s: float = 180.0) -> Iterator[tuple[str, int]]:
    """README's quick start (`serve run serve_app:app`, built-in engine) with `env`, from the repository
    root, until a chat is answered; yields its base URL and `serve run`'s pid; SIGINT to its session at the end."""
    serve = subprocess.Popen([str(GATEWAY_VENV_BIN / "serve"), "run", "serve_app:app"], cwd=REPO, env=env,
                             stdout=log_path.open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    chat = {"model": "mmserve-builtin", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello!"}]}
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.post(base + "/v1/chat/completions", json=chat, timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or serve.poll() is not None:
                raise RuntimeError(log_path.read_text(errors="replace")[-3000:])
            time.sleep(0.5)
        yield base, serve.pid
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        serve.wait(timeout=90)
        while not port_is_free(port):
            time.sleep(1)


def serve_environment(readme_env: dict[str, str], overrides: dict[str, str]) -> dict[str, str]:
    """The user's shell as this bench got it, minus every Ray setting, plus README's and --serve-env's."""
    base = {k: v for k, v in START_ENV.items() if not k.startswith("RAY_") and k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return {**base, **readme_env, **overrides}


# How mmserve's engine is started (`--mmserve-engine`): on its own, as `vllm serve --headless` beside
# `serve run` (its own session, so its own scheduling group under Linux's autogroup), or launched by the
# application (`engine_launch`: a Ray actor's child, in Ray's session), README's usual way.
ENGINE_STARTS = ("headless", "launched")
# The launcher's Ray CPUs: any amount that fits beside the replicas on 2 CPUs (bookkeeping only).
LAUNCHED_ENGINE_RAY_CPUS = 0.25


def launched_engine_arg(engine_node: EngineNode | None = None) -> str:
    """`engine_launch=…` for `serve run`: the headless engine's flags and environment, launched by the app
    (on the engine node's CPUs when there is one)."""
    launch = {
        "count": 1, "resources": {"CPU": LAUNCHED_ENGINE_RAY_CPUS}, "env": dict(VLLM_CPU_ENV),
        "engine_args": {"max-model-len": MAX_MODEL_LEN, "enforce-eager": True, "dtype": "bfloat16", "seed": 0},
        "vllm_command": [*(engine_node.taskset if engine_node else []), reference_python(), "-m", "vllm.entrypoints.cli.main"],
    }
    return "engine_launch=" + json.dumps(launch, separators=(",", ":"))


def launched_engine_root(proc: psutil.Process) -> int | None:
    """The pid of the launched `vllm serve --headless` that `proc` is or descends from, else None."""
    for candidate in [proc, *proc.parents()]:
        text = cmdline(candidate)
        if "vllm.entrypoints.cli.main serve" in text and "--headless" in text:
            return candidate.pid
    return None


def start_mmserve_engine(engine_start: str, model_dir: Path, log_path: Path,
                         engine_node: EngineNode | None = None) -> tuple[HeadlessVllmEngine | None, str]:
    """mmserve's engine as `--mmserve-engine` says: (the headless engine started here, or None when the
    application launches it; the `serve run` argument that names it)."""
    if engine_start == "launched":
        return None, launched_engine_arg(engine_node)
    hs_port = free_tcp_port()
    # The engine connects to the handshake address serve run will bind (ZMQ retries until then).
    with forking_on(engine_node and engine_node.engine_cpus):
        engine = HeadlessVllmEngine(model_dir, hs_port, max_model_len=MAX_MODEL_LEN, log_path=log_path, as_users_run=True).start()
    return engine, f"engines=tcp://127.0.0.1:{hs_port}"


def run_mmserve(run: int, model_dir: Path, work: Path, bodies: dict[str, list[dict[str, Any]]], warm: list[dict[str, Any]],
                timing: Timing, env: dict[str, str], port: int, engine_start: str = "launched",
                engine_node: EngineNode | None = None) -> SystemRun:
    how = "`vllm serve --headless` on its own" if engine_start == "headless" else "its engine launched by the app"
    print(f"== run {run}: mmserve (`serve run` as README starts it, {how})", flush=True)
    t0 = time.monotonic()
    engine, engine_arg = start_mmserve_engine(engine_start, model_dir, work / f"vllm_headless_{run}.log", engine_node)
    serve = ServeRun([f"model={model_dir}", f"served_model_name={MODEL_NAME}", engine_arg, *SERVE_ARGS_EXTRA],
                     env, port, work / f"serve_run_{run}.log")
    bench_pid = os.getpid()

    def engine_root(proc: psutil.Process) -> int | None:
        if engine is not None:
            return engine.pid if engine.pid in ancestors(proc) else None
        return launched_engine_root(proc)

    def member(proc: psutil.Process) -> str | None:
        if proc.pid == bench_pid:
            return CLIENT
        if engine_root(proc) is not None:
            return ENGINE
        return GATEWAY if serve.owns(proc) else None

    def label(proc: psutil.Process, role: str) -> str:
        if role == GATEWAY:
            return serve.label(proc)
        return engine_label(proc, engine_root(proc) or -1) if role == ENGINE else "bench client"

    meter = ProcessMeter(member, label)
    try:
        serve.start()

        def dead() -> str | None:
            if engine is not None and not engine.is_alive():
                return f"the headless engine exited:\n{engine.log_tail()}"
            return serve.dead()

        wait_ready(serve.base_url, 900, dead)
        system = SystemRun(SYSTEMS["mmserve"], run, time.monotonic() - t0)
        card = httpx.get(serve.base_url + "/v1/models", timeout=30).json()["data"][0]
        system.notes["image resize path"] = str(card.get("mmserve", {}).get("image_resize", "?"))
        measure_system(system, serve.base_url, meter, bodies, warm, timing)
        return system
    finally:
        serve.stop(meter)
        if engine is not None:
            engine.stop()


# ----------------------------------------------------------------------------- report


def med(values: list[float]) -> float:
    values = [v for v in values if v == v]  # NaN: no successful request in that run
    return statistics.median(values) if values else float("nan")


def fmt(value: float, digits: int = 1) -> str:
    return "–" if value != value else f"{value:.{digits}f}"


def ratio(a: float, b: float) -> str:
    return "–" if a != a or b != b or not a else f"**{b / a:.2f}×**"


class Report:
    """Medians over runs of each metric, by system and workload."""

    def __init__(self, runs: list[SystemRun]) -> None:
        self.runs = runs

    def of(self, system: str) -> list[SystemRun]:
        return [r for r in self.runs if r.system == system]

    def wl(self, system: str, workload: str, metric: Callable[[WorkloadRun], float]) -> float:
        return med([metric(w) for r in self.of(system) if (w := r.workload(workload)) is not None])

    def idle(self, system: str, metric: Callable[[CpuUse], float]) -> float:
        return med([metric(r.idle) for r in self.of(system) if r.idle is not None])

    def headline(self) -> str:
        v, m = SYSTEMS["vllm"], SYSTEMS["mmserve"]
        rows = [
            "| workload | gateway CPU ms/request, vLLM · mmserve | **CPU ratio** | req/s, vLLM · mmserve | **req/s ratio** "
            "| TTFT p50 ms, vLLM · mmserve | **TTFT ratio** | TPOT p50 ms, vLLM · mmserve | **TPOT ratio** | failed, vLLM · mmserve |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        metrics: list[tuple[Callable[[WorkloadRun], float], int]] = [
            (lambda w: w.ms_per_request(GATEWAY), 1), (lambda w: w.rps, 2),
            (lambda w: w.ttft_p50_ms, 1), (lambda w: w.tpot_p50_ms, 2),
        ]
        for w in WORKLOADS:
            cells = []
            for metric, digits in metrics:
                a, b = self.wl(v, w.name, metric), self.wl(m, w.name, metric)
                cells += [f"{fmt(a, digits)} · {fmt(b, digits)}", ratio(a, b)]
            failed = " · ".join(str(sum(x.failed for r in self.of(s) if (x := r.workload(w.name)))) for s in (v, m))
            rows.append(f"| {w.name} | " + " | ".join(cells) + f" | {failed} |")
        a, b = (self.idle(s, lambda c: c.role_s(GATEWAY) / c.wall_s) for s in (v, m))
        rows.append(f"| idle, gateway cores | {fmt(a, 3)} · {fmt(b, 3)} | {ratio(a, b)} | | | | | | | |")
        other = [med([x.cpu.other_cores for r in self.of(s) for x in r.workloads]) for s in (v, m)]
        rows.append(f"| other jobs' load during the workloads, cores (median) | {fmt(other[0], 2)} · {fmt(other[1], 2)} | | | | | | | | |")
        return "\n".join(rows)

    def less_idle(self) -> str:
        """Gateway CPU per request less what the gateway burns idle over the same time (each run's own idle phase):
        the cost a request adds, apart from the floor a small deployment pays whether it serves or not."""
        v, m = SYSTEMS["vllm"], SYSTEMS["mmserve"]
        rows = ["| workload | gateway CPU ms/request, vLLM · mmserve | idle's share of it, vLLM · mmserve "
                "| less idle, vLLM · mmserve | **ratio less idle** |", "|---|---:|---:|---:|---:|"]
        for w in WORKLOADS:
            whole = [self.wl(s, w.name, lambda x: x.ms_per_request(GATEWAY)) for s in (v, m)]
            net = [med([x.ms_per_request_less_idle(GATEWAY, r.idle.role_s(GATEWAY) / r.idle.wall_s)
                        for r in self.of(s) if r.idle is not None and (x := r.workload(w.name)) is not None]) for s in (v, m)]
            cells = [" · ".join(fmt(a) for a in whole), " · ".join(fmt(a - b) for a, b in zip(whole, net)),
                     " · ".join(fmt(a) for a in net), ratio(*net)]
            rows.append(f"| {w.name} | " + " | ".join(cells) + " |")
        return "\n".join(rows)

    def by_process(self) -> str:
        """Gateway CPU ms per request (idle: cores) of each process label, medians over runs."""
        rows = ["| system: process (processes) | " + " | ".join(w.name for w in WORKLOADS) + " | idle, cores |",
                "|---|" + "---:|" * (len(WORKLOADS) + 1)]
        for system in SYSTEMS.values():
            runs = self.of(system)
            phases = [c for r in runs for c in [r.idle, *(w.cpu for w in r.workloads)] if c is not None]
            totals: dict[str, float] = {}
            counts: dict[str, int] = {}
            for c in phases:
                for label, s in c.seconds.get(GATEWAY, {}).items():
                    totals[label] = totals.get(label, 0.0) + s
                    counts[label] = max(counts.get(label, 0), c.processes.get(GATEWAY, {}).get(label, 0))
            for label in sorted(totals, key=lambda k: -totals[k]):
                cells = [fmt(self.wl(system, w.name, lambda x, label=label: x.ms_per_request(GATEWAY, label)), 2) for w in WORKLOADS]
                idle = self.idle(system, lambda c, label=label: c.seconds.get(GATEWAY, {}).get(label, 0.0) / c.wall_s)
                rows.append(f"| {system}: {label} ({counts[label]}) | " + " | ".join(cells) + f" | {fmt(idle, 4)} |")
            if totals:
                cells = [f"**{fmt(self.wl(system, w.name, lambda x: x.ms_per_request(GATEWAY)), 2)}**" for w in WORKLOADS]
                idle = self.idle(system, lambda c: c.role_s(GATEWAY) / c.wall_s)
                rows.append(f"| **{system}: gateway total** | " + " | ".join(cells) + f" | **{fmt(idle, 4)}** |")
        return "\n".join(rows)

    def all_metrics(self) -> str:
        rows = ["| workload | system | ok (failed), summed over runs | req/s | TTFT ms p50 / p90 | TPOT ms p50 / p90 | latency ms p50 "
                "| CPU ms/request: gateway · engine · client | other load, cores | prompt tokens |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for w in WORKLOADS:
            for system in SYSTEMS.values():
                done = [x for r in self.of(system) if (x := r.workload(w.name)) is not None]
                if not done:
                    continue

                def m(metric: Callable[[WorkloadRun], float], digits: int = 1) -> str:
                    return fmt(self.wl(system, w.name, metric), digits)

                prompt = sorted({p for x in done for p in x.prompt_tokens})
                rows.append(
                    f"| {w.name} | {system} | {sum(x.ok for x in done)} ({sum(x.failed for x in done)}) | {m(lambda x: x.rps, 2)} "
                    f"| {m(lambda x: x.ttft_p50_ms)} / {m(lambda x: x.ttft_p90_ms)} | {m(lambda x: x.tpot_p50_ms, 2)} / {m(lambda x: x.tpot_p90_ms, 2)} "
                    f"| {m(lambda x: x.latency_p50_ms)} "
                    f"| {m(lambda x: x.ms_per_request(GATEWAY))} · {m(lambda x: x.ms_per_request(ENGINE))} · {m(lambda x: x.ms_per_request(CLIENT))} "
                    f"| {m(lambda x: x.cpu.other_cores, 2)} | {', '.join(map(str, prompt))} |")
        return "\n".join(rows)

    def per_run(self) -> str:
        v, m = SYSTEMS["vllm"], SYSTEMS["mmserve"]
        pairs = [(a, b) for a in self.of(v) for b in self.of(m) if a.run == b.run]
        if not pairs:
            return "(needs both systems)"
        rows = ["| workload | " + " | ".join(f"run {a.run}: CPU · req/s · TTFT p50 · TPOT p50" for a, _ in pairs) + " |",
                "|---|" + "---:|" * len(pairs)]
        for w in WORKLOADS:
            cells = []
            for a, b in pairs:
                x, y = a.workload(w.name), b.workload(w.name)
                if x is None or y is None:
                    cells.append("–")
                    continue
                cells.append(" · ".join(ratio(f(x), f(y)).strip("*") for f in (
                    lambda r: r.ms_per_request(GATEWAY), lambda r: r.rps, lambda r: r.ttft_p50_ms, lambda r: r.tpot_p50_ms)))
            rows.append(f"| {w.name} | " + " | ".join(cells) + " |")
        return "\n".join(rows)


def machine_facts() -> str:
    """Like gateway_bench.machine_facts, for this gateway venv (vLLM's version comes from the reference venv)."""
    cpu_model = platform.processor() or "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu_model = line.split(":", 1)[1].strip()
            break

    def v(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True).stdout
    return (
        f"Machine: {platform.machine()}, {psutil.cpu_count(logical=True)} logical cores ({psutil.cpu_count(logical=False)} physical), "
        f"{cpu_model}, {psutil.virtual_memory().total / 2**30:.0f} GiB; load average at start {os.getloadavg()[0]:.2f}.\n"
        f"Code: commit {commit}{f' with uncommitted changes to {len(dirty.splitlines())} file(s)' if dirty else ''}.\n"
        f"Gateway venv: Python {platform.python_version()}, ray {v('ray')}, fastapi {v('fastapi')}, uvicorn {v('uvicorn')}, "
        f"pyzmq {v('pyzmq')}, Pillow {v('pillow')}, Pillow-SIMD {v('pillow-simd')}; reference venv: {reference_vllm_version()}."
    )


def write_report(out: Path, runs: list[SystemRun], meta: dict[str, Any]) -> str:
    report = Report(runs)
    title = "## Front-end cost: mmserve vs vLLM's API server" + (f" ({meta['label']})" if meta["label"] else "")
    workloads = "; ".join(f"{w.name}: {w.max_tokens} tokens out" for w in WORKLOADS)
    text = "\n".join([
        title, "",
        f"Command: `{meta['command']}` ({meta['runs']} run(s), {meta['duration_s'] / 60:.1f} min).",
        meta["machine"], "",
        f"mmserve: `{meta['serve_command']}` from the repository root: the Ray instance's settings README's quick start gives "
        f"it (`{meta['readme_line']}`, `cluster/ray.env`) plus --serve-env, and no other `RAY_*` variable; "
        f"image resize path: {', '.join(sorted(meta['resize_paths'])) or '–'}. Engine (both systems): `{meta['engine_flags']}`; "
        f"mmserve's {'started on its own (`--headless`, its own session)' if meta['mmserve_engine'] == 'headless' else 'launched by the application (`engine_launch`, in Ray’s session)'}. "
        f"Placement: {meta.get('engine_node') or 'every process on every CPU (one shared node)'}.",
        f"Workloads (streamed chat, temperature 0, `ignore_eos`, closed loop, no new request after {meta['workload_s']:g} s): {workloads}; "
        f"images {IMAGE_SIZE[0]}×{IMAGE_SIZE[1]} JPEG data URIs. Idle: {meta['idle_s']:g} s after the warm-up. "
        "Gateway = every non-engine process (vLLM: its API server; mmserve: all of `serve run`'s, Ray's and Serve's); "
        f"the bench client is reported apart; its scheduling group: {meta.get('client_group', 'not set (before 2026-12-06)')}. "
        "Medians over runs; ratios are mmserve ÷ vLLM of the medians.",
        "", "### Headline", "", report.headline(), "",
        "TPOT with 8 tokens out is coarse: on a small machine a request's chunks often reach the client in one burst "
        "(client or server waiting for a core), which puts its p50 near 0; request latency (below) is the robust measure there.",
        "", "### Gateway CPU per request less the gateway's idle cost", "",
        "The idle phase's gateway cores × the workload's wall time ÷ its requests is what the gateway would have "
        "burnt over that time serving nothing (Ray's floor, for mmserve); the rest is what the requests added.", "",
        report.less_idle(),
        "", "### Gateway CPU by process, ms per request (idle: cores)", "", report.by_process(),
        "", "### All metrics (medians over runs)", "", report.all_metrics(),
        "", "### Ratios per run (mmserve ÷ vLLM)", "", report.per_run(), "",
    ])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text


def write_json(path: Path, runs: list[SystemRun], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "results": [asdict(r) for r in runs]}, indent=1, default=sorted))


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: few requests, short phases")
    parser.add_argument("--label", default="", help="names this configuration (title, default output file)")
    parser.add_argument("--out", help="markdown report (default bench/results/frontend[-LABEL].md); the JSON goes beside it")
    parser.add_argument("--setups", default="vllm,mmserve", help="comma-separated: vllm, mmserve")
    parser.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE",
                        help="adds to / overrides README's environment for `serve run`; repeatable")
    parser.add_argument("--mmserve-engine", choices=ENGINE_STARTS, default="launched",
                        help="mmserve's engine: launched by the application (`engine_launch`, a Ray actor's child; "
                             "default), or `vllm serve --headless` started on its own; the same flags either way")
    parser.add_argument("--client-group-nice", type=int, default=CLIENT_GROUP_NICE,
                        help="niceness of the client's scheduling group while the bench runs (0: the default weight)")
    parser.add_argument("--engine-cpus", metavar="LIST",
                        help="emulate an engine node of its own: each engine alone on these CPUs, each front end "
                             "(vLLM's API server, mmserve's gateway) and the client on the others (e.g. 1)")
    parser.add_argument("--report-from", metavar="FILE.json",
                        help="run nothing: rewrite the markdown report of a saved JSON (to --out, default beside it)")
    args = parser.parse_args()
    if args.report_from:
        saved = json.loads(Path(args.report_from).read_text())
        meta = {k: v for k, v in saved.items() if k != "results"}
        out = Path(args.out or Path(args.report_from).with_suffix(".md"))
        write_report(out, [SystemRun.from_json(r) for r in saved["results"]], meta)
        print(f"wrote {out}")
        return
    setups = args.setups.split(",")
    if unknown := set(setups) - set(SYSTEMS):
        parser.error(f"unknown setups {sorted(unknown)}")
    out = Path(args.out or REPO / "bench" / "results" / (f"frontend-{args.label}.md" if args.label else "frontend.md"))
    timing = QUICK if args.quick else FULL
    try:
        engine_node = EngineNode.parse(args.engine_cpus) if args.engine_cpus else None
    except ValueError as exc:
        parser.error(str(exc))
    if engine_node is not None:
        os.sched_setaffinity(0, engine_node.front_cpus)  # the client, and what it starts but the engines
    readme_line, readme_env, port = readme_quick_start()
    overrides = dict(kv.split("=", 1) for kv in args.serve_env)
    env = serve_environment(readme_env, overrides)
    meta: dict[str, Any] = {
        "command": " ".join([".venv/bin/python bench/frontend_bench.py", *map(shlex.quote, sys.argv[1:])]),
        "label": args.label, "runs": args.runs, "quick": args.quick, "machine": machine_facts(),
        "readme_line": readme_line, "serve_env": {**readme_env, **overrides}, "port": port,
        "serve_command": " ".join(f"{k}={v}" for k, v in {**readme_env, **overrides}.items())
        + " .venv/bin/serve run serve_app:build_app model=DIR served_model_name=" + MODEL_NAME
        + (" engines=tcp://127.0.0.1:PORT " if args.mmserve_engine == "headless" else f" {launched_engine_arg(engine_node)} ")
        + " ".join(SERVE_ARGS_EXTRA), "mmserve_engine": args.mmserve_engine,
        "engine_flags": f"vllm serve DIR --max-model-len {MAX_MODEL_LEN} --enforce-eager --dtype bfloat16 --seed 0",
        "workloads": [asdict(w) for w in WORKLOADS], "workload_s": timing.workload_s, "idle_s": timing.idle_s,
        "resize_paths": set(), "engine_node": engine_node.describe() if engine_node else None,
    }
    print(meta["machine"], flush=True)
    if "mmserve" in setups and not port_is_free(port):
        sys.exit(f"port {port} (README's quick start port, where serve run listens) is busy: stop whatever serves there first")
    print(f"serve run environment (README + --serve-env): {meta['serve_env'] or 'none'}; port {port}", flush=True)

    started = time.monotonic()
    bodies, warm = make_bodies(args.quick)
    runs: list[SystemRun] = []
    with client_scheduling_group(args.client_group_nice) as meta["client_group"], \
            tempfile.TemporaryDirectory(prefix="frontend_bench_") as tmp:
        print(f"client's scheduling group: {meta['client_group']}", flush=True)
        work = Path(tmp)
        model_dir = build_tiny_qwen2_vl(work / MODEL_NAME, seed=0)
        for run in range(1, args.runs + 1):
            if "vllm" in setups:
                runs.append(run_vllm(run, model_dir, work, bodies, warm, timing, engine_node))
            if "mmserve" in setups:
                runs.append(run_mmserve(run, model_dir, work, bodies, warm, timing, env, port, args.mmserve_engine, engine_node))
                meta["resize_paths"].add(runs[-1].notes["image resize path"])
            meta["duration_s"] = time.monotonic() - started
            write_json(out.with_suffix(".json"), runs, meta)  # after every run: a partial result survives a failure
    print("\n" + write_report(out, runs, meta))
    print(f"wrote {out} and {out.with_suffix('.json')}")
    if left := psutil.Process().children(recursive=True):
        print(f"!! processes of this bench still running: {[(p.pid, cmdline(p)[:80]) for p in left]}")


if __name__ == "__main__":
    main()

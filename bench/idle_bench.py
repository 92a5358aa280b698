"""What the gateway burns doing nothing, by process, with README's command and with Ray settings that cut it.

    .venv/bin/python bench/idle_bench.py [--seconds 30] [--runs 3] [--variant NAME=K=V[,K=V...] ...] [--ray-floor] [--out FILE.md]

Starts the service as README's quick start does (`serve run serve_app:app` with README's environment,
the built-in engine), waits until it answers a chat, lets it settle, then reads the CPU time of every
process of that `serve run` (Ray's and Serve's included; the built-in engine is not the gateway and is
reported apart) over `--seconds` with no request. Each variant adds Ray settings to README's
environment; runs alternate between variants. Reports the median cores per process group.
Not a test; run it alone on the machine.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import frontend_bench as fb  # noqa: E402  (puts the repository on sys.path)
from replica_threads import thread_cpu  # noqa: E402

import psutil  # noqa: E402

DEFAULT_VARIANTS = {
    "README": {},
    "control loop 0.5 s": {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"},
    "metrics export 1 s": {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"},
    "both": {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"},
}


def tree(root: psutil.Process) -> list[psutil.Process]:
    return [root, *root.children(recursive=True)]


def cpu_seconds(procs: list[psutil.Process]) -> dict[int, tuple[str, float]]:
    out = {}
    for proc in procs:
        try:
            times = proc.cpu_times()
            label = "built-in engine (not gateway)" if "mmserve.builtin_engine" in fb.cmdline(proc) else fb.gateway_label(fb.cmdline(proc))
            out[proc.pid] = (label, times.user + times.system)
        except psutil.Error:
            pass
    return out


# A Ray instance with nothing but two do-nothing actors (one sync, one async): it prints their pids, then
# waits for its stdin to close.
RAY_FLOOR_SCRIPT = """
import os, sys, ray
ray.init(include_dashboard=False, num_cpus=2, log_to_driver=False)

@ray.remote
class Idle:
    def pid(self):
        return os.getpid()

@ray.remote
class AsyncIdle:
    async def pid(self):
        return os.getpid()

actors = [Idle.remote(), AsyncIdle.remote()]
print(*ray.get([a.pid.remote() for a in actors]), flush=True)
sys.stdin.read()
"""


def ray_floor(seconds: float, settle_s: float) -> list[tuple[float, float]]:
    """(cores of the whole process, cores of its main thread) of each do-nothing Ray actor over `seconds`.
    Every Ray worker's main thread wakes every 10 ms to check for signals (`CoreWorker::RunTaskExecutionLoop`,
    not configurable in Ray 2.60): this is what each replica, the Serve controller and proxy pay idle."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    with subprocess.Popen([str(fb.GATEWAY_VENV_BIN / "python"), "-c", RAY_FLOOR_SCRIPT], env=env, text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        pids = [int(x) for x in proc.stdout.readline().split()]
        time.sleep(settle_s)
        before = {pid: {tid: cpu for tid, (_, cpu) in thread_cpu(pid).items()} for pid in pids}
        t0 = time.monotonic()
        time.sleep(seconds)
        after = {pid: {tid: cpu for tid, (_, cpu) in thread_cpu(pid).items()} for pid in pids}
        wall = time.monotonic() - t0
        proc.stdin.close()
        proc.wait(timeout=60)
    return [(sum(cpu - before[pid].get(tid, 0.0) for tid, cpu in after[pid].items()) / wall,
             (after[pid][pid] - before[pid][pid]) / wall) for pid in pids]


def measure(env: dict[str, str], port: int, seconds: float, settle_s: float) -> dict[str, float]:
    """Cores per process label over `seconds` of idleness."""
    with tempfile.TemporaryDirectory(prefix="idle_bench_") as tmp, fb.quick_start_serving(env, port, Path(tmp) / "serve.log") as (_, pid):
        time.sleep(settle_s)
        root = psutil.Process(pid)
        before = cpu_seconds(tree(root))
        t0 = time.monotonic()
        time.sleep(seconds)
        after = cpu_seconds(tree(root))
        wall = time.monotonic() - t0
    cores: dict[str, float] = collections.defaultdict(float)
    for pid, (label, cpu) in after.items():
        cores[label] += max(0.0, cpu - before.get(pid, (label, 0.0))[1]) / wall
    return dict(cores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after the first answer before measuring")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], help="NAME=K=V[,K=V...]: Ray settings added to README's")
    parser.add_argument("--out")
    parser.add_argument("--ray-floor", action="store_true",
                        help="also measure, once per run, a Ray instance holding only two do-nothing actors")
    args = parser.parse_args()
    variants = {v.split("=", 1)[0]: dict(kv.split("=", 1) for kv in v.split("=", 1)[1].split(",") if kv) for v in args.variant} or DEFAULT_VARIANTS
    _, readme_env, port = fb.readme_quick_start()
    results: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    floors: list[tuple[float, float]] = []
    for run in range(args.runs):
        if args.ray_floor:
            floors += ray_floor(args.seconds, args.settle)
            print(f"run {run + 1} Ray's floor: {floors[-2:]} (process, main thread) cores per do-nothing actor", flush=True)
        for name, extra in variants.items():
            cores = measure(fb.serve_environment(readme_env, extra), port, args.seconds, args.settle)
            results[name].append(cores)
            gateway = sum(v for k, v in cores.items() if not k.startswith("built-in engine"))
            print(f"run {run + 1} {name}: gateway {gateway:.3f} cores", flush=True)
    labels = sorted({label for runs in results.values() for cores in runs for label in cores})
    median = {name: {label: statistics.median(c.get(label, 0.0) for c in runs) for label in labels} for name, runs in results.items()}
    totals = {name: statistics.median(sum(v for k, v in c.items() if not k.startswith("built-in engine")) for c in runs)
              for name, runs in results.items()}
    lines = [f"Idle, {args.seconds:g} s per run, {args.runs} runs, medians (cores). README's environment: {readme_env}.", "",
             "| process | " + " | ".join(f"{n} ({', '.join(f'{k}={v}' for k, v in variants[n].items()) or 'as README'})" for n in variants) + " |",
             "|---|" + "---:|" * len(variants),
             "| **gateway total** | " + " | ".join(f"**{totals[n]:.3f}**" for n in variants) + " |"]
    lines += [f"| {label} | " + " | ".join(f"{median[n][label]:.3f}" for n in variants) + " |" for label in labels
              if max(median[n][label] for n in variants) >= 0.0005]
    if floors:
        lines += ["", f"A do-nothing Ray actor (Ray's floor: what each replica, the Serve controller and its proxies pay idle), "
                      f"median of {len(floors)} actors (a sync and an async one per run): **{statistics.median(f[0] for f in floors):.4f}** cores, "
                      f"of which its main thread's 10-ms signal check {statistics.median(f[1] for f in floors):.4f}."]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

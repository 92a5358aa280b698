"""When do a streamed text answer's chunks reach the client? mmserve before a real vLLM engine, c=1.

    .venv/bin/python bench/stream_delivery_probe.py [--requests 6] [--serve-env K=V ...]
                                                    [--renice-gateway N] [--renice-engine N]
                                                    [--mmserve-engine launched|headless] [--direct]
                                                    [--client-group-nice N]

Starts what `bench/frontend_bench.py` starts for mmserve (README's `serve run` and environment, a
`vllm serve --headless` engine on the tiny Qwen2-VL, launched by the app or, with `--mmserve-engine
headless`, on its own), sends streamed chats one at a time (64 tokens,
`ignore_eos`) and prints, per request, how many content chunks arrived, when the first and the last
did, and how many before half the request's time, and per process how long its threads ran and how long
they waited for a CPU while runnable during the request (the kernel's schedstat): a request whose tokens were held back somewhere
arrives in two or three chunks at its end (its TTFT is then its whole latency). With
`--renice-gateway` / `--renice-engine`, every thread of the Serve replicas and HAProxy / of the engine's
processes is given that niceness after the warm-up (niceness is per thread on Linux; a negative
value needs root). Prints the niceness each process runs at. With `--direct`, every other request goes
straight to the ingress replica's own HTTP server (Serve's direct ingress, found in HAProxy's config)
instead of through HAProxy: where a held-back answer is held. The client (this process) is measured
too, in its scheduling group at niceness -10 as in `frontend_bench.py` (with `--client-group-nice 0`,
the default weight, it was the client that held answers back, waiting up to 170 ms for a core).
A probe, not a benchmark: one run, nothing asserted; run it alone on the machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import frontend_bench as fb  # noqa: E402  (puts the repository on sys.path)

import httpx  # noqa: E402
import psutil  # noqa: E402

from tests.support.haproxy import haproxy_config, healthy_ingress_replica_url  # noqa: E402

GATEWAY_MARKS = ("ServeReplica:", "haproxy")


def chunk_times(base_url: str, body: dict) -> tuple[float, list[float]]:
    """(request start, arrival of each chunk with content), perf_counter seconds."""
    started, arrivals = time.perf_counter(), []
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", base_url + "/v1/chat/completions", json={**body, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    arrivals.append(time.perf_counter())
    return started, arrivals


def processes(marks: tuple[str, ...]) -> list[psutil.Process]:
    """Processes whose command line contains one of `marks`."""
    return [proc for proc in psutil.process_iter(["cmdline"]) if any(m in " ".join(proc.info["cmdline"] or []) for m in marks)]


def cpu_and_wait_ms(procs: list[psutil.Process]) -> dict[str, tuple[float, float]]:
    """Per process (by name): ms on a CPU and ms runnable but waiting for one, summed over its threads
    (/proc/PID/task/TID/schedstat: the kernel's run time and run-queue wait, ns)."""
    totals: dict[str, tuple[float, float]] = {}
    for proc in procs:
        name = " ".join(proc.cmdline())[:40] or proc.name()
        ran = waited = 0
        try:
            for tid in os.listdir(f"/proc/{proc.pid}/task"):
                with open(f"/proc/{proc.pid}/task/{tid}/schedstat") as f:
                    run_ns, wait_ns, _ = f.read().split()
                ran, waited = ran + int(run_ns), waited + int(wait_ns)
        except (FileNotFoundError, ProcessLookupError):
            continue
        totals[name] = (ran / 1e6, waited / 1e6)
    return totals


def ingress_replica_url(gateway: list[psutil.Process], haproxy_port: int) -> str:
    """An ingress replica's own HTTP address, from the config HAProxy was started with."""
    for proc in gateway:
        config = haproxy_config(" ".join(proc.cmdline()))
        if config is not None and (url := healthy_ingress_replica_url(config, haproxy_port)) is not None:
            return url
    raise LookupError("no ingress replica found in HAProxy's config")


def renice_threads(procs: list[psutil.Process], niceness: int) -> int:
    tids = [tid for proc in procs for tid in os.listdir(f"/proc/{proc.pid}/task")]
    subprocess.run(["renice", "-n", str(niceness), "-p", *tids], check=True, capture_output=True)
    return len(tids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--renice-gateway", type=int)
    parser.add_argument("--renice-engine", type=int)
    parser.add_argument("--mmserve-engine", choices=fb.ENGINE_STARTS, default="launched",
                        help="as frontend_bench's: the engine on its own, or launched by the application")
    parser.add_argument("--direct", action="store_true", help="every other request straight to the ingress replica, not through HAProxy")
    parser.add_argument("--client-group-nice", type=int, default=fb.CLIENT_GROUP_NICE,
                        help="as frontend_bench's: the niceness of the client's scheduling group (0: the default weight)")
    args = parser.parse_args()
    with fb.client_scheduling_group(args.client_group_nice) as group:
        print(f"client's scheduling group: {group}")
        probe(args)


def probe(args: argparse.Namespace) -> None:
    body = fb.gb.chat_body(fb.MODEL_NAME, 64, token_ids=False)
    _, readme_env, port = fb.readme_quick_start()
    env = fb.serve_environment(readme_env, dict(item.split("=", 1) for item in args.serve_env))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = fb.build_tiny_qwen2_vl(work / fb.MODEL_NAME, seed=0)
        engine, engine_arg = fb.start_mmserve_engine(args.mmserve_engine, model_dir, work / "engine.log")
        serve = fb.ServeRun([f"model={model_dir}", f"served_model_name={fb.MODEL_NAME}", engine_arg, *fb.SERVE_ARGS_EXTRA],
                            env, port, work / "serve.log")
        # What `serve.stop` terminates if `serve run` leaves it behind: serve run's own processes.
        gateway_meter = fb.ProcessMeter(lambda proc: fb.GATEWAY if serve.owns(proc) else None, lambda proc, role: "")
        try:
            serve.start()
            fb.wait_ready(serve.base_url, 900, lambda: None if engine is None or engine.is_alive() else f"engine exited:\n{engine.log_tail()}")
            for _ in range(3):
                chunk_times(serve.base_url, body)
            if engine is not None:
                engine_root = psutil.Process(engine.pid)
            else:  # the launched engine: the `vllm serve --headless` under the launcher actor
                engine_root = next(p for p in psutil.process_iter() if fb.launched_engine_root(p) == p.pid)
            engine_procs = [engine_root, *engine_root.children(recursive=True)]
            gateway = [p for p in processes(GATEWAY_MARKS + ("ray::EngineLauncher",)) if p not in engine_procs]
            if args.renice_gateway is not None:
                print(f"gateway: {renice_threads(gateway, args.renice_gateway)} threads reniced to {args.renice_gateway}")
            if args.renice_engine is not None:
                print(f"engine: {renice_threads(engine_procs, args.renice_engine)} threads reniced to {args.renice_engine}")
            for proc in [*gateway, *engine_procs]:
                print(f"  niceness {proc.nice():3d} (main thread): {' '.join(proc.cmdline())[:90]}")
            print(f"serve env: {env}")
            direct_url = ingress_replica_url(gateway, port) if args.direct else None
            for index in range(args.requests):
                url = direct_url if direct_url is not None and index % 2 else serve.base_url
                # This process too: the client that reads the chunks, in a scheduling group of its own.
                measured = [*gateway, *engine_procs, psutil.Process()]
                before = cpu_and_wait_ms(measured)
                started, arrivals = chunk_times(url, body)
                after = cpu_and_wait_ms(measured)
                offsets = [(t - started) * 1e3 for t in arrivals]
                half = offsets[-1] / 2
                print(f"request {index}{' (straight to the replica)' if url != serve.base_url else ''}: {len(offsets)} chunks, "
                      f"first {offsets[0]:.0f} ms, last {offsets[-1]:.0f} ms, {sum(o < half for o in offsets)} before half-time", flush=True)
                for name, (ran, waited) in after.items():
                    if name in before and ran - before[name][0] >= 1:
                        print(f"    {name:40s} on CPU {ran - before[name][0]:6.1f} ms, waiting for one "
                              f"{waited - before[name][1]:6.1f} ms")
        finally:
            serve.stop(gateway_meter)
            if engine is not None:
                engine.stop()


if __name__ == "__main__":
    main()

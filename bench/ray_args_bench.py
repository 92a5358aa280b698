"""CPU per Ray actor call carrying a data URI: as one argument (the object store) or cut into pieces
that travel inside the call (`deployments/inline_args.py`).

    .venv/bin/python bench/ray_args_bench.py [--calls 400] [--sizes 130000,400000,1000000,2000000] [--runs 3]

Each run starts a fresh local Ray (2 CPUs, no dashboard); one actor calls another with a distinct
string of each size, 8 calls in flight, as the ingress calls the preprocessor. Measured: CPU seconds
of every process of the machine but this driver (the two actors, the raylet, GCS and the rest of
Ray) per call, and objects created in the object store per call (the raylet's own counter). Not a
test; run it alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _one(size: int, cut: bool, calls: int) -> dict[str, float]:
    import psutil
    import ray
    from ray._private.internal_api import node_stats

    from deployments.inline_args import PIECE_CHARS

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Callee:
        async def take(self, *pieces: str) -> int:
            return len("".join(pieces))

    @ray.remote(num_cpus=0)
    class Caller:
        def __init__(self, callee) -> None:
            self.callee = callee

        async def run(self, n: int, size: int, cut: bool) -> int:
            base = "x" * size

            async def one(i: int) -> int:
                payload = f"{i:08d}" + base[8:]
                if cut:
                    return await self.callee.take.remote(*[payload[s : s + PIECE_CHARS] for s in range(0, size, PIECE_CHARS)])
                return await self.callee.take.remote(payload)

            for start in range(0, n, 8):
                await asyncio.gather(*[one(start + j) for j in range(8)])
            return n

    def cpu() -> float:
        total = 0.0
        for proc in psutil.process_iter():
            if proc.pid == os.getpid():
                continue
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
        return total

    def created() -> int:
        [node] = ray.nodes()
        return node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False).store_stats.cumulative_created_objects

    caller = Caller.remote(Callee.remote())
    ray.get(caller.run.remote(40, size, cut))  # warm up
    cpu0, objects0 = cpu(), created()
    ray.get(caller.run.remote(calls, size, cut))
    result = {"cpu_ms": (cpu() - cpu0) / calls * 1000, "objects": (created() - objects0) / calls}
    ray.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--sizes", default="130000,400000,1000000,2000000")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # "SIZE,CUT": one measurement, in a process of its own
    args = parser.parse_args()
    if args.one:
        size, cut = args.one.split(",")
        print(json.dumps(_one(int(size), cut == "1", args.calls)))
        return
    print("| data URI, bytes | whole: CPU ms/call (runs) | cut: CPU ms/call (runs) | objects/call whole · cut |")
    print("|---:|---:|---:|---:|")
    for size in [int(s) for s in args.sizes.split(",")]:
        results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for _ in range(args.runs):
            for cut in (False, True):
                out = subprocess.run(
                    [sys.executable, __file__, "--one", f"{size},{int(cut)}", "--calls", str(args.calls)],
                    capture_output=True, text=True, check=True,
                ).stdout
                results[cut].append(json.loads(out.strip().splitlines()[-1]))
                time.sleep(1)

        def cell(cut: bool) -> str:
            values = [r["cpu_ms"] for r in results[cut]]
            return f"**{statistics.median(values):.2f}** ({', '.join(f'{v:.2f}' for v in values)})"

        objects = " · ".join(f"{statistics.median(r['objects'] for r in results[cut]):.1f}" for cut in (False, True))
        print(f"| {size:,} | {cell(False)} | {cell(True)} | {objects} |", flush=True)


if __name__ == "__main__":
    main()

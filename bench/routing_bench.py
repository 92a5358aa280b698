"""What engine choice costs the ingress per request: CPU microseconds of the routing path alone.

The work `EngineRouter` does per request to choose an engine, as it does it: the request's affinity
keys (a digest of each image reference, hashes of its 128-token prompt blocks), the lookup in the
replica's affinity table, the content's home engine (rendezvous hashing), the choice within the load
bound, and the table's update; against the least-loaded choice alone (`routing.affinity: false`).
Requests: a 2 000-token prompt, half of them with one ≈100 KB data-URI image, content repeated at
random from a pool so that the table holds a realistic mix of hits and misses, 2 and 8 engines with
random loads. No Ray, no I/O: per-request CPU of the pure functions, medians of 3 runs.

Usage: .venv/bin/python bench/routing_bench.py [--requests 20000] [--runs 3]
"""

from __future__ import annotations

import argparse
import base64
import random
import statistics
import time

from mmserve.transit.affinity import AffinityTable, affinity_keys, choose_engine, home_engine, image_key

PROMPT_TOKENS = 2000
IMAGE_BYTES = 100_000


def _workload(requests: int, seed: int) -> list[tuple[list[int], list[str]]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 150_000) for _ in range(PROMPT_TOKENS)] for _ in range(64)]
    images = ["data:image/jpeg;base64," + base64.b64encode(rng.randbytes(IMAGE_BYTES)).decode() for _ in range(64)]
    return [(rng.choice(prompts), [rng.choice(images)] if rng.random() < 0.5 else []) for _ in range(requests)]


def _run(work, engines: int, affinity: bool, seed: int) -> float:
    rng = random.Random(seed)
    table = AffinityTable(65_536)
    ready = [str(i) for i in range(engines)]  # engines as the router names them
    routed = dict.fromkeys(ready, 0)
    loads_seq = [{name: rng.randrange(0, 12) for name in ready} for _ in range(256)]
    start = time.process_time()
    for n, (prompt, urls) in enumerate(work):
        loads = loads_seq[n % 256]
        if affinity:
            keys = affinity_keys(prompt, [image_key(url) for url in urls])
            name = choose_engine(ready, loads, routed, table.affine_engines(keys), 8, home_engine(keys, ready))
            table.record(keys, name)
        else:
            name = choose_engine(ready, loads, routed, {}, 8)
        routed[name] += 1
    return (time.process_time() - start) / len(work) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    work = _workload(args.requests, seed=1)
    print(f"routing CPU per request (µs), {args.requests} requests, {PROMPT_TOKENS}-token prompts, half with a "
          f"{IMAGE_BYTES // 1000} KB image (as a data URI), median of {args.runs} runs")
    print("| engines | affinity (keys, table, home, choice) | least loaded only |")
    print("|---:|---:|---:|")
    for engines in (2, 8):
        with_affinity = statistics.median(_run(work, engines, True, seed) for seed in range(args.runs))
        without = statistics.median(_run(work, engines, False, seed) for seed in range(args.runs))
        print(f"| {engines} | {with_affinity:.1f} | {without:.1f} |")


if __name__ == "__main__":
    main()

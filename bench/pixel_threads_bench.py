"""Preprocessor CPU per image when eight requests' pixel work shares one core: one pixel thread (the
replica's default, `preprocessor.num_cpus` = 1) against six (what asyncio's default thread pool gave
it on 2 cores before issue 16's change).

    .venv/bin/python bench/pixel_threads_bench.py [--images 120] [--rounds 3]

The process is pinned to one core (a replica reserving 1 CPU), the processed-image cache is off,
640×480 JPEG data URIs are distinct (`image_chat_bench.ImageMaker`), 8 requests in flight; CPU is
this process's user + system time. Rounds alternate between the settings; medians are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import image_chat_bench as ic  # noqa: E402  (puts the repository on sys.path)

from deployments.preprocessor import build_preprocessor  # noqa: E402
from mmserve.multimodal import ImageBatchRequest, PixelMode  # noqa: E402
from serve_app.config import AppConfig  # noqa: E402
from serve_app.settings import preprocessor_settings  # noqa: E402

CONCURRENCY = 8


async def cpu_ms_per_image(pixel_threads: int, uris: list[str], config: AppConfig) -> float:
    settings = preprocessor_settings(config)
    pre = build_preprocessor(type(settings)(**{**settings.__dict__, "cache_bytes": 0, "pixel_threads": pixel_threads}))
    slots = asyncio.Semaphore(CONCURRENCY)
    mode = PixelMode(config.images.pixel_mode)

    async def one(uri: str) -> None:
        async with slots:
            await pre.process(ImageBatchRequest(urls=[uri], pixel_mode=mode, engine_dtype="bfloat16"))

    started = time.process_time()
    await asyncio.gather(*(one(uri) for uri in uris))
    return (time.process_time() - started) / len(uris) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    config = AppConfig()
    maker = ic.ImageMaker(640, 480)
    seeds = iter(range(1, 10**9))
    results: dict[int, list[float]] = {1: [], 6: []}
    for _ in range(args.rounds):
        for threads in results:
            uris = [maker.uri(next(seeds)) for _ in range(args.images)]
            results[threads].append(asyncio.run(cpu_ms_per_image(threads, uris, config)))
    for threads, values in results.items():
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"{threads} pixel thread(s): {statistics.median(values):.2f} ms CPU per image (runs: {runs})")


if __name__ == "__main__":
    main()

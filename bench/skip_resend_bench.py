"""Repeated images with and without skip-resend: bytes the engine client sends, and time to first token.

    python bench/skip_resend_bench.py [--rounds 15] [--images-per-request 4] [--size 1280x960]

One real `vllm serve --headless` CPU engine (tiny random Qwen2-VL, `tests/support/tiny_models.py`,
vLLM's default processor cache: lru, 4 GiB) and one `EngineClient` in this process — the layer
skip-resend lives in, without the Serve hops whose noise would hide it. The images are preprocessed
once (our Qwen2-VL path, uint8 patches) and sent once to warm the engine's cache. Then rounds
alternate between the two modes on the same engine, so drift in machine load hits both alike:

- **skip-resend** (the default): the engine client's mirror says the engine holds the images; they
  go by hash only (`data: None`);
- **full data**: the mirror switched off, every pixel tensor is sent again (what the engine client
  did before, and what it still does for engines whose cache it cannot mirror).

Per request: bytes handed to ZMQ for the ADD (body + tensor frames) and TTFT (from `generate()`
to the first output carrying a token; greedy, max_tokens 1). Medians over the rounds. Not a test:
nothing is asserted about timings; the engine shares 2 cores with this process.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from mmserve.engine import EngineAddresses, EngineClient  # noqa: E402
from mmserve.multimodal import ProcessedImages, attach_images, load_image_family, pixel_dtype_for  # noqa: E402
from mmserve.multimodal.types import PixelMode  # noqa: E402
from mmserve.vision import decode_rgb  # noqa: E402
from mmserve.wire import EngineCoreRequest, SamplingParams  # noqa: E402
from tests.support.defaults import engine_client_config, image_limits  # noqa: E402
from tests.support.tiny_models import build_tiny_qwen2_vl  # noqa: E402
from tests.support.vllm_engines import HeadlessVllmEngine, free_tcp_port  # noqa: E402


def _jpeg(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    arr = np.clip(np.stack([x % 256, y % 256, (x + y) % 256], -1) + rng.integers(-30, 30, (height, width, 3)), 0, 255)
    buf = io.BytesIO()
    Image.fromarray(arr.astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _request(request_id: str, images: ProcessedImages, vision_start: int, vision_end: int) -> EngineCoreRequest:
    # <|vision_start|> <|image_pad|> <|vision_end|> per image, around a few ordinary tokens.
    prompt = [20, 21, 22]
    for _ in images.images:
        prompt += [vision_start, images.placeholder_token_id, vision_end]
    prompt += [23, 24]
    request = EngineCoreRequest(
        request_id=request_id, prompt_token_ids=prompt, mm_features=None,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None, data_parallel_rank=None,
    )
    return attach_images(request, images)


async def _one(client: EngineClient, request: EngineCoreRequest) -> tuple[int, float]:
    before = client.bytes_sent
    started = time.perf_counter()
    ttft = None
    async for batch in client.generate(request):
        if ttft is None and any(o.new_token_ids for o in batch):
            ttft = time.perf_counter() - started
    assert ttft is not None
    return client.bytes_sent - before, ttft * 1e3


async def run(args: argparse.Namespace) -> str:
    width, height = (int(v) for v in args.size.split("x"))
    workdir = Path(tempfile.mkdtemp(prefix="skip_resend_bench_"))
    model_dir = build_tiny_qwen2_vl(workdir / "tiny-qwen2-vl", seed=0)
    family = load_image_family(model_dir)
    dtype = pixel_dtype_for(PixelMode.DEVICE_NORMALIZE, "bfloat16")
    images = ProcessedImages(
        images=[family.process(decode_rgb(_jpeg(width, height, seed), image_limits()), dtype) for seed in range(args.images_per_request)],
        placeholder_token_id=family.placeholder_token_id, family=family.name,
    )
    config = json.loads((model_dir / "config.json").read_text())
    tokens = config["vision_start_token_id"], config["vision_end_token_id"]
    pixel_bytes = sum(f.array.nbytes for image in images.images for f in image.fields)

    port = free_tcp_port()
    engine = HeadlessVllmEngine(model_dir, port, max_model_len=4096, as_users_run=True).start()
    client = EngineClient(engine_client_config(
        EngineAddresses(f"tcp://127.0.0.1:{port}"), handshake_timeout_s=600, health_check_interval_s=1.0, health_check_timeout_s=30.0,
    ))
    try:
        await client.start()
        mirror = client.adds.mirror
        assert mirror is not None
        for i in range(2):  # warm-up: the engine caches the images, compiles nothing twice
            await _one(client, _request(f"warm{i}", images, *tokens))
        results: dict[str, list[tuple[int, float]]] = {"skip-resend": [], "full data": []}
        for r in range(args.rounds):
            for mode in (("skip-resend", "full data") if r % 2 == 0 else ("full data", "skip-resend")):
                client.adds.mirror = mirror if mode == "skip-resend" else None
                results[mode].append(await _one(client, _request(f"{mode}-{r}", images, *tokens)))
        client.adds.mirror = mirror
        assert client.adds.cache_miss_resends == 0
    finally:
        await client.close()
        engine.stop()

    lines = [
        f"{args.images_per_request} × {width}×{height} JPEG per request, {images.images[0].fields[0].array.shape[0]} patches each: "
        f"{pixel_bytes} bytes of uint8 patches per request; {args.rounds} rounds per mode, alternating; medians.",
        "",
        "| mode | bytes sent per request | TTFT p50 (ms) |",
        "|---|---:|---:|",
    ]
    for mode, rows in results.items():
        lines.append(f"| {mode} | {int(statistics.median(b for b, _ in rows))} | {statistics.median(t for _, t in rows):.1f} |")
    full = statistics.median(t for _, t in results["full data"])
    skip = statistics.median(t for _, t in results["skip-resend"])
    lines.append("")
    lines.append(f"TTFT ratio full / skip-resend: {full / skip:.2f}×")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--images-per-request", type=int, default=4)
    parser.add_argument("--size", default="1280x960")
    print(asyncio.run(run(parser.parse_args())))


if __name__ == "__main__":
    main()

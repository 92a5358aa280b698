"""Images per second per core: mmserve.vision vs Hugging Face's Qwen2-VL / CLIP processors.

    python bench/preprocess_bench.py [--rounds 5] [--seconds 0.6]

Everything runs on one thread (torch, OpenMP, OpenBLAS), from JPEG bytes to the engine's tensors, on
synthetic photos-like JPEGs (gradients, shapes, noise; quality 90). Each cell is the best of several
interleaved timed rounds (the machine is shared; the best round is the least disturbed one). Rows:

- floor: JPEG decode alone; decode + stock Pillow bicubic resize to the same target (not exact);
- mmserve: `decode_rgb` + `Qwen2VLSettings.process` (uint8 = vLLM 0.32's default device
  normalisation; bf16 = normalised and cast), and `+ hash` adds the content hash;
- HF: `Qwen2VLImageProcessor` (torchvision backend, what vLLM uses) and `Qwen2VLImageProcessorPil`,
  both fed the decoded PIL image, returning torch tensors;
- LLaVA: `LlavaSettings.process` vs `CLIPImageProcessor` (torchvision), bf16.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import io  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import PIL  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmserve.vision import LlavaSettings, PixelDtype, Qwen2VLSettings, decode_rgb  # noqa: E402
from mmserve.vision.resize import pillow_simd_active  # noqa: E402

torch.set_num_threads(1)

SIZES = [(640, 480), (1280, 960), (1920, 1080)]  # width, height


def synthetic_jpeg(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    image = np.stack([xs * 255 // width, ys * 255 // height, ((xs // 40 + ys // 40) % 2) * 180 + 40], axis=-1)
    for _ in range(25):
        y0, x0 = rng.integers(0, height), rng.integers(0, width)
        r = rng.integers(10, min(width, height) // 3)
        image[(ys - y0) ** 2 + (xs - x0) ** 2 < r * r] = rng.integers(0, 256, 3)
    image = np.clip(image + rng.normal(0, 6, image.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def seconds_per_image(fn, seconds: float) -> float:
    fn()  # warm caches (weights per size, lazy imports)
    count, start = 0, time.perf_counter()
    while True:
        fn()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / count


def command_line() -> str:
    """The command as typed, including a PYTHONPATH override (how a pillow-simd run is made)."""
    prefix = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    return prefix + " ".join(shlex.quote(a) for a in ["python", *sys.argv])


def pil_rgb(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image.convert("RGB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.6, help="length of one timed round")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "preprocess.md"))
    parser.add_argument("--append", action="store_true", help="append to --out instead of replacing it")
    args = parser.parse_args()

    from transformers import CLIPImageProcessor, Qwen2VLImageProcessor

    try:
        from transformers import Qwen2VLImageProcessorPil
    except ImportError:
        Qwen2VLImageProcessorPil = None

    qwen = Qwen2VLSettings()  # HF defaults: min 3136, max 1003520 pixels (= Qwen2-VL-7B's max_pixels default)
    llava = LlavaSettings()
    hf_tv = Qwen2VLImageProcessor()
    hf_pil = Qwen2VLImageProcessorPil() if Qwen2VLImageProcessorPil else None
    hf_clip = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})

    targets = [qwen.resized_size(width, height) for width, height in SIZES]
    jpegs = [synthetic_jpeg(w, h) for w, h in SIZES]

    methods: list[tuple[str, object]] = [
        ("floor: JPEG decode (Pillow) to RGB array", lambda d, t: np.asarray(pil_rgb(d))),
        (
            "floor: decode + stock Pillow bicubic resize (not exact)",
            lambda d, t: np.asarray(pil_rgb(d).resize((t[1], t[0]), Image.Resampling.BICUBIC)),
        ),
        ("**mmserve Qwen2-VL uint8** (decode + process)", lambda d, t: qwen.process(decode_rgb(d))),
        ("mmserve Qwen2-VL uint8 + content hash", lambda d, t: qwen.process(decode_rgb(d)).content_hash),
        ("**mmserve Qwen2-VL bf16** (decode + process)", lambda d, t: qwen.process(decode_rgb(d), PixelDtype.BFLOAT16)),
        (
            "HF Qwen2-VL torchvision uint8 (decode + processor)",
            lambda d, t: hf_tv(images=[pil_rgb(d)], do_rescale=False, do_normalize=False, return_tensors="pt"),
        ),
        (
            "HF Qwen2-VL torchvision bf16 (decode + processor + cast)",
            lambda d, t: hf_tv(images=[pil_rgb(d)], return_tensors="pt")["pixel_values"].to(torch.bfloat16),
        ),
    ]
    if hf_pil is not None:
        methods += [
            (
                "HF Qwen2-VL PIL backend uint8 (decode + processor)",
                lambda d, t: hf_pil(images=[pil_rgb(d)], do_rescale=False, do_normalize=False, return_tensors="pt"),
            ),
            (
                "HF Qwen2-VL PIL backend bf16 (decode + processor + cast)",
                lambda d, t: hf_pil(images=[pil_rgb(d)], return_tensors="pt")["pixel_values"].to(torch.bfloat16),
            ),
        ]
    methods += [
        ("**mmserve LLaVA bf16** (decode + process)", lambda d, t: llava.process(decode_rgb(d))),
        (
            "HF CLIP torchvision bf16 (decode + processor + cast)",
            lambda d, t: hf_clip(images=[pil_rgb(d)], return_tensors="pt")["pixel_values"].to(torch.bfloat16),
        ),
    ]

    # Interleaved: every round times every method once, so background load hits all of them alike;
    # each cell keeps its best round.
    best = [[float("inf")] * len(SIZES) for _ in methods]
    for _ in range(args.rounds):
        for m, (_, fn) in enumerate(methods):
            for s, (data, target) in enumerate(zip(jpegs, targets)):
                best[m][s] = min(best[m][s], seconds_per_image(lambda: fn(data, target), args.seconds))
    rows = [(label, [1.0 / b for b in best[m]]) for m, (label, _) in enumerate(methods)]

    header = "| images/s, 1 thread | " + " | ".join(
        f"{w}×{h} → {t[1]}×{t[0]}" for (w, h), t in zip(SIZES, targets)
    ) + " |"
    lines = [
        "## Image preprocessing throughput",
        "",
        f"Command: `{command_line()}` "
        f"(best of {args.rounds} interleaved rounds of {args.seconds} s per cell; OMP/OpenBLAS/torch threads = 1).",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, shared with other jobs; Python {platform.python_version()}, "
        f"numpy {np.__version__}, Pillow {PIL.__version__} (pillow-simd active: {pillow_simd_active()}), torch {torch.__version__}.",
        "Targets are the Qwen2-VL default sizes (max_pixels 1003520); LLaVA rows crop 336×336 from the same JPEGs.",
        "",
        header,
        "|---|" + "---:|" * len(SIZES),
    ]
    lines += [f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + " |" for label, values in rows]
    if hf_pil is None:
        lines += ["", "transformers has no Qwen2VLImageProcessorPil in this version."]
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a" if args.append else "w") as out:
        out.write(("\n" if args.append else "") + text)


if __name__ == "__main__":
    main()

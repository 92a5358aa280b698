"""Images per second per core: mmserve.vision vs Hugging Face's Qwen2-VL / CLIP processors.

    python bench/preprocess_bench.py [--rounds 5] [--seconds 0.4] [--clock cpu|wall] [--resize auto|numba|numpy]

Everything runs on one thread (torch, OpenMP, OpenBLAS, MKL), from the same JPEG bytes to the engine's
tensors, on synthetic photo-like JPEGs (gradients, shapes, noise; quality 90). Both sides decode those
bytes with the same Pillow build: HF is fed `Image.open(...).convert("RGB")` (cheaper than vLLM's own
loader, which also runs `exif_transpose` and so copies every image), ours runs `decode_rgb` (vLLM's
conversion rules, limits checked). Each cell is the best of several interleaved rounds; by default the
clock is the process's CPU time (`time.process_time`), i.e. seconds of one core, which a loaded, shared
machine disturbs far less than wall time (all work is single-threaded, so the two agree on a quiet one).

Rows:
- floor: JPEG decode alone (to a PIL image; to a numpy array); decode + exact resize alone
  (`--resize auto`: pillow-simd when installed, else the compiled one, else the numpy one; `numba` or
  `numpy` forces that path) and decode + torch's uint8 antialiased resize;
- mmserve: `decode_rgb` + `Qwen2VLSettings.process` — the gateway's path (uint8 = vLLM 0.32's default
  device normalisation; bf16 = normalised and cast), `+ content hash`, and `decode_image` + `process`
  (the PIL image handed over without a numpy round trip);
- HF: `Qwen2VLImageProcessor` (torchvision backend, what vLLM uses), returning torch tensors, and
  `CLIPImageProcessor` (torchvision) for LLaVA; bf16 rows add `.to(torch.bfloat16)` as vLLM does.
The ratio table divides each mmserve row by its HF counterpart.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
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
from mmserve.vision.image_io import decode_image  # noqa: E402
from mmserve.vision import resize as resize_module  # noqa: E402
from mmserve.vision.resize import pillow_simd_active, resize_channels, resize_path  # noqa: E402
from tests.support.defaults import image_limits  # noqa: E402

LIMITS = image_limits()

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


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def seconds_per_image(fn, seconds: float, clock) -> float:
    fn()  # warm caches (weights and lookup tables per size, lazy imports)
    count, start = 0, clock()
    while True:
        fn()
        count += 1
        elapsed = clock() - start
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


def torch_resize(image: Image.Image, target: tuple[int, int]):
    tensor = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None]  # as torchvision's pil_to_tensor
    return torch.nn.functional.interpolate(tensor, size=list(target), mode="bicubic", align_corners=False, antialias=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.4, help="length of one timed round")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="cpu: process CPU time; wall: perf_counter")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "preprocess.md"))
    parser.add_argument("--append", action="store_true", help="append to --out instead of replacing it")
    parser.add_argument("--families", default="qwen2_vl,llava,qwen3_vl",
                        help="comma-separated subset of qwen2_vl, llava, qwen3_vl (floors come with qwen2_vl)")
    parser.add_argument("--resize", choices=["auto", "numba", "numpy"], default="auto",
                        help="the exact resize our rows use: auto = what the service would pick; numba/numpy force one")
    args = parser.parse_args()
    if args.resize != "auto":
        resize_module._pillow_simd_verdict = False
        resize_module._numba_verdict = args.resize == "numba"
    resize_module.warm_up()
    families = set(args.families.split(","))
    clock = CLOCKS[args.clock]

    from transformers import CLIPImageProcessor, Qwen2VLImageProcessor

    qwen = Qwen2VLSettings()  # HF defaults: min 3136, max 1003520 pixels (= Qwen2-VL-7B's max_pixels default)
    llava = LlavaSettings()
    hf_tv = Qwen2VLImageProcessor()
    hf_clip = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    # Qwen3-VL's shipped preprocessor_config.json: the same processor class, 16x16 patches (factor 32),
    # mean/std 0.5, 65 536 to 16 777 216 pixels (so these sizes are only rounded to multiples of 32).
    qwen3_config = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3,
                    "image_std": [0.5] * 3, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
    qwen3 = Qwen2VLSettings.from_config(qwen3_config)
    hf_qwen3 = Qwen2VLImageProcessor(**qwen3_config)
    bf16 = PixelDtype.BFLOAT16
    exact_resize = resize_path()

    targets = [qwen.resized_size(width, height) for width, height in SIZES]
    jpegs = [synthetic_jpeg(w, h) for w, h in SIZES]

    # (label, fn(data, target), key): rows sharing a key are compared in the ratio table.
    methods: list[tuple[str, object, str]] = [
        ("floor: JPEG decode to RGB PIL image", lambda d, t: pil_rgb(d), ""),
        ("floor: JPEG decode to RGB numpy array (`decode_rgb`)", lambda d, t: decode_rgb(d, LIMITS), ""),
        (f"floor: decode + exact resize alone ({exact_resize})", lambda d, t: resize_channels(decode_image(d, LIMITS), *t), ""),
        ("floor: decode + torch uint8 antialiased bicubic alone", lambda d, t: torch_resize(pil_rgb(d), t), ""),
        ("**mmserve Qwen2-VL uint8** (`decode_rgb` + process)", lambda d, t: qwen.process(decode_rgb(d, LIMITS)), "ours:q8"),
        ("mmserve Qwen2-VL uint8 (`decode_image` + process)", lambda d, t: qwen.process(decode_image(d, LIMITS)), "alt:q8"),
        ("mmserve Qwen2-VL uint8 + content hash", lambda d, t: qwen.process(decode_rgb(d, LIMITS)).content_hash, "hash:q8"),
        ("HF Qwen2-VL torchvision uint8 (decode + processor)",
         lambda d, t: hf_tv(images=[pil_rgb(d)], do_rescale=False, do_normalize=False, return_tensors="pt"), "hf:q8"),
        ("**mmserve Qwen2-VL bf16** (`decode_rgb` + process)", lambda d, t: qwen.process(decode_rgb(d, LIMITS), bf16), "ours:qbf"),
        ("mmserve Qwen2-VL bf16 (`decode_image` + process)", lambda d, t: qwen.process(decode_image(d, LIMITS), bf16), "alt:qbf"),
        ("HF Qwen2-VL torchvision bf16 (decode + processor + cast)",
         lambda d, t: hf_tv(images=[pil_rgb(d)], return_tensors="pt")["pixel_values"].to(torch.bfloat16), "hf:qbf"),
        ("**mmserve LLaVA bf16** (`decode_rgb` + process)", lambda d, t: llava.process(decode_rgb(d, LIMITS)), "ours:lbf"),
        ("mmserve LLaVA bf16 (`decode_image` + process)", lambda d, t: llava.process(decode_image(d, LIMITS)), "alt:lbf"),
        ("HF CLIP torchvision bf16 (decode + processor + cast)",
         lambda d, t: hf_clip(images=[pil_rgb(d)], return_tensors="pt")["pixel_values"].to(torch.bfloat16), "hf:lbf"),
        ("**mmserve Qwen3-VL uint8** (`decode_rgb` + process)", lambda d, t: qwen3.process(decode_rgb(d, LIMITS)), "ours:q3u8"),
        ("mmserve Qwen3-VL uint8 (`decode_image` + process)", lambda d, t: qwen3.process(decode_image(d, LIMITS)), "alt:q3u8"),
        ("HF Qwen3-VL torchvision uint8 (decode + processor)",
         lambda d, t: hf_qwen3(images=[pil_rgb(d)], do_rescale=False, do_normalize=False, return_tensors="pt"), "hf:q3u8"),
        ("**mmserve Qwen3-VL bf16** (`decode_rgb` + process)", lambda d, t: qwen3.process(decode_rgb(d, LIMITS), bf16), "ours:q3bf"),
        ("HF Qwen3-VL torchvision bf16 (decode + processor + cast)",
         lambda d, t: hf_qwen3(images=[pil_rgb(d)], return_tensors="pt")["pixel_values"].to(torch.bfloat16), "hf:q3bf"),
    ]
    family_of = {"q8": "qwen2_vl", "qbf": "qwen2_vl", "lbf": "llava", "q3u8": "qwen3_vl", "q3bf": "qwen3_vl", "": "qwen2_vl"}
    methods = [m for m in methods if family_of[m[2].partition(":")[2]] in families]

    # Interleaved: every round times every method once, so background load hits all of them alike;
    # each cell keeps its best round.
    best = [[float("inf")] * len(SIZES) for _ in methods]
    for _ in range(args.rounds):
        for m, (_, fn, _) in enumerate(methods):
            for s, (data, target) in enumerate(zip(jpegs, targets)):
                best[m][s] = min(best[m][s], seconds_per_image(lambda: fn(data, target), args.seconds, clock))
    rate = {key: [1.0 / b for b in best[m]] for m, (_, _, key) in enumerate(methods) if key}
    rows = [(label, [1.0 / b for b in best[m]]) for m, (label, _, _) in enumerate(methods)]

    sizes = " | ".join(f"{w}×{h} → {t[1]}×{t[0]}" for (w, h), t in zip(SIZES, targets))
    unit = "images per CPU-second, 1 thread" if args.clock == "cpu" else "images/s (wall), 1 thread"
    lines = [
        "## Image preprocessing throughput",
        "",
        f"Command: `{command_line()}` "
        f"(best of {args.rounds} interleaved rounds of {args.seconds} s per cell, clock: {args.clock}; "
        "OMP/OpenBLAS/MKL/torch threads = 1).",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores ({cpu_model()}), shared with other jobs "
        f"(load average at the end: {os.getloadavg()[0]:.1f}); Python {platform.python_version()}, numpy {np.__version__}, "
        f"Pillow {PIL.__version__} (pillow-simd active: {pillow_simd_active()}; our rows resize with {resize_path()}), torch {torch.__version__}, "
        f"transformers {transformers_version()}.",
        "Input: the same JPEG bytes for both sides, decoded by the same Pillow. "
        "Targets (column headers) are the Qwen2-VL default sizes (max_pixels 1003520); LLaVA rows crop 336×336 "
        "from the same JPEGs; Qwen3-VL rows resize to "
        + ", ".join(f"{t[1]}×{t[0]}" for t in (qwen3.resized_size(w, h) for w, h in SIZES))
        + " (its defaults, 16×16 patches).",
        "",
        f"| {unit} | {sizes} |",
        "|---|" + "---:|" * len(SIZES),
    ]
    lines += [f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + " |" for label, values in rows]
    lines += ["", f"| ratio mmserve / HF (images per core) | {sizes} |", "|---|" + "---:|" * len(SIZES)]
    for key, label in [
        ("q8", "Qwen2-VL uint8"),
        ("qbf", "Qwen2-VL bf16"),
        ("lbf", "LLaVA bf16"),
        ("q3u8", "Qwen3-VL uint8"),
        ("q3bf", "Qwen3-VL bf16"),
    ]:
        if f"hf:{key}" not in rate:
            continue
        hf = rate[f"hf:{key}"]
        for kind, how in [("ours", "`decode_rgb` + process"), ("alt", "`decode_image` + process"), ("hash", "+ content hash")]:
            if f"{kind}:{key}" in rate:
                ours = rate[f"{kind}:{key}"]
                bold = "**" if kind == "ours" else ""
                lines.append(f"| {bold}{label}, {how}{bold} | " + " | ".join(f"{bold}{o / h:.2f}×{bold}" for o, h in zip(ours, hf)) + " |")
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a" if args.append else "w") as out:
        out.write(("\n" if args.append else "") + text)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                flags = Path("/proc/cpuinfo").read_text()
                isa = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "no AVX2"
                return f"{line.split(':', 1)[1].strip()}, {isa}"
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()

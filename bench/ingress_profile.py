"""Where the gateway's own replicas spend their CPU per token: py-spy profiles under streamed text load.

    .venv/bin/python bench/ingress_profile.py [--seconds 15] [--concurrency 32] [--images] [--out FILE.md]

Starts the service exactly as README's quick start does (`serve run serve_app:app`, README's
environment, the built-in engine: no model work, so the gateway's own cost stands out), drives
streamed chat completions (64 tokens out, `ignore_eos`) at the given concurrency, and meanwhile
samples the Ingress and EngineClient0 replicas with `py-spy record` (the `py-spy` that `ray`
installs). Prints, per replica, the functions with the most samples on top of the stack (self time)
and the functions of this repository with the most samples anywhere on the stack (inclusive), as
shares of all samples. With `--images`, each request is issue 16's image chat instead (a distinct
640×480 JPEG data URI, 8 tokens out) and the Preprocessor replica is sampled too. Not a test; run it
alone on the machine. `--concurrency 0` profiles the idle replicas (what their own periodic work costs).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import frontend_bench as fb  # noqa: E402  (puts the repository on sys.path)

import httpx  # noqa: E402
import psutil  # noqa: E402

REPLICAS = {"Ingress": ":Ingress", "EngineClient0": ":EngineClient0"}
IMAGE_REPLICAS = {**REPLICAS, "Preprocessor": ":Preprocessor"}
OUR_PACKAGES = ("mmserve/", "deployments/", "serve_app/")
SAMPLE_RATE = 200
BODY = {
    "model": "mmserve-builtin", "stream": True, "max_tokens": 64, "ignore_eos": True, "temperature": 0,
    "messages": [{"role": "user", "content": "Describe a quiet river at morning, with the bridge, the market and the tower."}],
}


async def load(url: str, concurrency: int, seconds: float, bodies: Iterator[dict[str, Any]] | None = None) -> int:
    done = 0
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        async def worker() -> None:
            nonlocal done
            while time.monotonic() < deadline:
                body = next(bodies) if bodies is not None else BODY
                async with client.stream("POST", url, json=body) as response:
                    async for _ in response.aiter_lines():
                        pass
                if response.status_code != 200:
                    raise RuntimeError(f"answer {response.status_code}: the profile would measure refusals")
                done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


def image_bodies() -> Iterator[dict[str, Any]]:
    """Issue 16's image chat, a distinct image per request (made up front: making one costs ≈2 ms)."""
    maker = fb.ic.ImageMaker(*fb.IMAGE_SIZE)
    made = [{**fb.image_body(maker.uri(seed), 8), "model": BODY["model"]} for seed in range(1, 6001)]
    return iter(made)


def replica_pid(marker: str) -> int:
    for proc in psutil.process_iter(["cmdline"]):
        if any("ServeReplica" in part and marker in part for part in proc.info["cmdline"] or []):
            return proc.pid
    raise RuntimeError(f"no replica process matching {marker!r}")


def busy_samples(raw: Path) -> tuple[int, int]:
    """(all samples, samples with this repository's code on the stack): py-spy leaves idle threads
    out, so at `--rate` samples per second these are CPU time."""
    total = ours = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            total += int(count)
            ours += int(count) if any(f"({package}" in stack for package in OUR_PACKAGES) else 0
    return total, ours


def top_frames(raw: Path, top: int) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """(self, inclusive-in-this-repository) shares from py-spy's collapsed stacks."""
    self_counts: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        self_counts[frames[-1]] += n
        # py-spy names this repository's files relative to it, and installed packages by their path.
        for frame in set(f for f in frames if f.rsplit(" (", 1)[-1].startswith(OUR_PACKAGES)):
            ours[frame] += n
    share = lambda c: [(name, n / total) for name, n in c.most_common(top)] if total else []  # noqa: E731
    return share(self_counts), share(ours)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--images", action="store_true", help="image chats (distinct images, 8 tokens) instead of text")
    parser.add_argument("--out", help="also write the tables to this markdown file")
    args = parser.parse_args()
    bodies = image_bodies() if args.images else None
    replicas = IMAGE_REPLICAS if args.images else REPLICAS
    _, readme_env, port = fb.readme_quick_start()
    env = fb.serve_environment(readme_env, {})
    tmp = Path(tempfile.mkdtemp(prefix="ingress_profile_"))
    with fb.quick_start_serving(env, port, tmp / "serve_run.log") as (base, _):
        url = base + "/v1/chat/completions"
        asyncio.run(load(url, 4, 3.0, bodies))  # warm-up
        spies = {}
        for name, marker in replicas.items():
            raw = tmp / f"{name}.txt"
            spies[name] = (raw, subprocess.Popen(
                [str(fb.GATEWAY_VENV_BIN / "py-spy"), "record", "--format", "raw", "--rate", str(SAMPLE_RATE), "--nonblocking",
                 "--duration", str(int(args.seconds)), "--pid", str(replica_pid(marker)), "--output", str(raw)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
        done = asyncio.run(load(url, args.concurrency, args.seconds + 1, bodies))
        for _, spy in spies.values():
            spy.wait(timeout=60)
    sections = [f"Profile: `{' '.join(sys.argv)}`; README's environment {readme_env}; {done} streams of {8 if args.images else 64} tokens{' (image chats)' if args.images else ''} at "
                f"c={args.concurrency} in {args.seconds + 1:g} s (built-in engine)."]
    for name, (raw, _) in spies.items():
        own, ours = top_frames(raw, args.top)
        busy, busy_ours = busy_samples(raw)
        sections.append(f"\n{name}: {busy / SAMPLE_RATE / args.seconds:.4f} cores busy in Python, of which this repository's "
                        f"code {busy_ours / SAMPLE_RATE / args.seconds:.5f} ({busy} and {busy_ours} samples at {SAMPLE_RATE}/s)")
        sections += [f"\n#### {name}: top functions by self samples\n", "| share | function (file) |", "|---:|---|"]
        sections += [f"| {share:.1%} | `{frame}` |" for frame, share in own]
        sections += [f"\n#### {name}: this repository's functions by inclusive samples\n", "| share | function (file) |", "|---:|---|"]
        sections += [f"| {share:.1%} | `{frame}` |" for frame, share in ours]
    text = "\n".join(sections)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

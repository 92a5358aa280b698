"""CPU per request of each thread of the gateway's replicas, read from the kernel, under a streamed load.

    .venv/bin/python bench/replica_threads.py [--images] [--concurrency 8] [--seconds 20] [--out FILE.md]

Starts the service as README's quick start does (`serve run serve_app:app`, README's environment, the
built-in engine), warms it, then drives streamed chats (text: 64 tokens out at `--concurrency`; with
`--images`, issue 16's image chat: a distinct 640×480 JPEG data URI each, 8 tokens out) for `--seconds`
and reads every thread's CPU time of the Ingress, EngineClient0 and Preprocessor replicas from
`/proc/PID/task/TID/stat` before and after. Python threads are named from `py-spy dump` (Ray starts them
before it renames the process, so the kernel calls them all `ray::IDLE`); native threads keep the
kernel's name. Unlike a py-spy profile, a thread blocked in a C call costs nothing here. Not a test;
run it alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import frontend_bench as fb  # noqa: E402  (puts the repository on sys.path)
import image_chat_bench as ic  # noqa: E402
from ingress_profile import BODY, IMAGE_REPLICAS  # noqa: E402  (the profile's load: the same requests)

import psutil  # noqa: E402

PY_SPY_THREAD = re.compile(r'Thread (0x[0-9A-Fa-f]+|\d+) \((?:idle|active)[^)]*\): "([^"]+)"')


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Thread id -> (the kernel's name for it, CPU seconds user + system)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / tick)
    return out


def python_thread_names(pid: int) -> dict[int, str]:
    """Thread id -> Python thread name, from `py-spy dump` (which prints native thread ids)."""
    dump = subprocess.run([str(fb.GATEWAY_VENV_BIN / "py-spy"), "dump", "--pid", str(pid)], capture_output=True, text=True).stdout
    return {int(m.group(1), 16) if m.group(1).startswith("0x") else int(m.group(1)): m.group(2) for m in PY_SPY_THREAD.finditer(dump)}


def bodies(images: bool, count: int) -> list[dict]:
    """`ingress_profile`'s text request, or its image chat with a distinct image each."""
    if not images:
        return [BODY] * count
    maker = ic.ImageMaker(*fb.IMAGE_SIZE)
    return [{**fb.image_body(maker.uri(seed), 8), "model": BODY["model"]} for seed in range(1, count + 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", action="store_true")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()
    load = bodies(args.images, 3000 if args.images else 20000)
    warm, load = load[:16], load[16:]
    _, readme_env, port = fb.readme_quick_start()
    with tempfile.TemporaryDirectory(prefix="replica_threads_") as tmp, \
            fb.quick_start_serving(fb.serve_environment(readme_env, {}), port, Path(tmp) / "serve.log") as (base, pid):
        url = f"{base}/v1/chat/completions"
        asyncio.run(ic.closed_loop(url, warm, 4, 60))
        replicas = {name: proc.pid for proc in psutil.Process(pid).children(recursive=True)
                    for name, tag in IMAGE_REPLICAS.items() if tag in fb.cmdline(proc)}
        before = {name: thread_cpu(p) for name, p in replicas.items()}
        streams, elapsed, failed = asyncio.run(ic.closed_loop(url, load, args.concurrency, args.seconds))
        after = {name: thread_cpu(p) for name, p in replicas.items()}
        names = {name: python_thread_names(p) for name, p in replicas.items()}
    n = len(streams)
    kind = "image chats (distinct 640×480 JPEGs, 8 tokens out)" if args.images else "text chats (64 tokens out)"
    lines = [f"`{' '.join(['.venv/bin/python bench/replica_threads.py', *sys.argv[1:]])}`: {n} streamed {kind} at "
             f"c={args.concurrency} in {elapsed:.1f} s ({failed} failed), built-in engine, README's environment. "
             "CPU ms per request by thread (Python threads by their Python name).", "",
             "| replica | total | by thread |", "|---|---:|---|"]
    for name in replicas:
        by_thread: dict[str, float] = collections.defaultdict(float)
        for tid, (comm, cpu) in after[name].items():
            by_thread[names[name].get(tid, comm)] += cpu - before[name].get(tid, (comm, 0.0))[1]
        ranked = sorted(by_thread.items(), key=lambda kv: -kv[1])
        cells = ", ".join(f"{thread} {1e3 * s / n:.2f}" for thread, s in ranked if 1e3 * s / n >= 0.05)
        lines.append(f"| {name} | **{1e3 * sum(by_thread.values()) / n:.2f}** | {cells} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

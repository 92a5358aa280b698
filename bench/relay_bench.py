"""CPU per output of the engine client's relay, outside Ray: what an EngineClient replica spends
passing each engine step's outputs on to an ingress replica.

    .venv/bin/python bench/relay_bench.py [--seconds 10] [--concurrency 1] [--runs 3]

One process holds what an EngineClient replica runs on the output path (`EngineClient` reading the
engine's output socket, a `CallerChannel` per caller, the `subscribe` loop of
`deployments/engine_client.py` sending `OutputBatch`es over a `LinkOutbox`), on uvloop as Ray's
workers run it, and nothing else: no Ray, no Serve. A built-in engine subprocess (2 ms steps) serves
streamed 64-token requests (`ignore_eos`) at the given concurrency; the caller's `LinkInbox` is read
in a subprocess of its own, so its CPU is not counted. Prints this process's CPU time (all threads,
zmq's I/O thread included) per output (one request's new tokens of one engine step: at c=1, per step)
and per request, and that time by thread (`/proc/self/task/*/schedstat`: the event loop, zmq's I/O
thread, any other). Not a test; run it alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import uvloop  # noqa: E402

from mmserve.builtin_engine import builtin_engine_command  # noqa: E402
from mmserve.engine import EngineAddresses, EngineClient  # noqa: E402
from mmserve.transit.sockets import LinkOutbox  # noqa: E402
from mmserve.engine.outputs import CallerChannel  # noqa: E402
from mmserve.transit.engine_link import OutputBatch, RequestFailed, encode  # noqa: E402
from mmserve.wire import EngineCoreRequest, SamplingParams  # noqa: E402
from tests.support.defaults import engine_client_config  # noqa: E402

TOKENS = 64
PROMPT = list(range(100, 160))
# The caller's end: binds a PULL socket, prints its address, reads until it is killed.
INBOX_READER = """
import zmq
sock = zmq.Context.instance().socket(zmq.PULL)
port = sock.bind_to_random_port("tcp://127.0.0.1")
print(f"tcp://127.0.0.1:{port}", flush=True)
while True:
    sock.recv()
"""


def request(number: int) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=f"relay-{number}", prompt_token_ids=PROMPT, mm_features=None,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True),
        pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None, data_parallel_rank=None,
    )


async def relay(channel: CallerChannel, outbox: LinkOutbox) -> None:
    """`EngineClientDeployment.subscribe`'s loop after its first item."""
    while True:
        outputs, failures, _ = await channel.take()
        outbox.send(OutputBatch(outputs, [RequestFailed(rid, why) for rid, why in failures]), encode)


def thread_cpu_ns() -> dict[str, int]:
    """CPU time (ns) of each of this process's threads, by name (Python's names where it has them)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    times: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run_ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended
            continue
        name = names.get(int(tid), comm)
        times[name] = times.get(name, 0) + run_ns
    return times


async def measure(seconds: float, concurrency: int) -> tuple[float, float, int, dict[str, float]]:
    """(CPU ms per output, CPU ms per request, requests, µs per output by thread) of one run."""
    client = EngineClient(engine_client_config(EngineAddresses("tcp://127.0.0.1:0"), handshake_timeout_s=60))
    client.bind()
    engine = subprocess.Popen(builtin_engine_command(client.handshake_address, max_model_len=1024, max_num_seqs=256,
                                                     step_interval_ms=2.0, step_us_per_sequence=0.0, step_us_per_prefill_token=0.0))
    reader = subprocess.Popen([sys.executable, "-c", INBOX_READER], stdout=subprocess.PIPE, text=True)
    try:
        await client.start()
        assert reader.stdout is not None
        outbox = LinkOutbox(reader.stdout.readline().strip())
        channel = CallerChannel()
        relay_task = asyncio.get_running_loop().create_task(relay(channel, outbox))
        numbers = iter(range(10**9))
        steps = done = 0

        async def one() -> None:
            nonlocal done
            req = request(next(numbers))
            finished = asyncio.Event()
            channel.track(req.request_id)
            # Count the steps as the output loop hands them over (the channel's own put does the work).
            put = channel.put

            def counting_put(output) -> None:
                nonlocal steps
                steps += output.request_id == req.request_id
                put(output)
                if output.finished and output.request_id == req.request_id:
                    finished.set()

            sink = _Sink(counting_put, channel.fail)
            await client.add(req, sink)
            await finished.wait()
            done += 1

        async def worker(deadline: float) -> None:
            while time.monotonic() < deadline:
                await one()

        await asyncio.gather(*(worker(time.monotonic() + 1.0) for _ in range(concurrency)))  # warm-up
        steps = done = 0
        cpu0, threads0 = time.process_time(), thread_cpu_ns()
        await asyncio.gather(*(worker(time.monotonic() + seconds) for _ in range(concurrency)))
        cpu, threads1 = time.process_time() - cpu0, thread_cpu_ns()
        relay_task.cancel()
        outbox.close()
        by_thread = {name: (ns - threads0.get(name, 0)) / 1e3 / max(steps, 1) for name, ns in threads1.items()}
        return cpu * 1e3 / max(steps, 1), cpu * 1e3 / max(done, 1), done, by_thread
    finally:
        await client.close()
        engine.terminate()
        engine.wait(10)
        reader.kill()
        reader.wait(10)


class _Sink:
    """An `OutputSink` from two functions (the counting wrapper around the channel)."""

    def __init__(self, put, fail) -> None:
        self.put = put
        self.fail = fail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    results = [uvloop.run(measure(args.seconds, args.concurrency)) for _ in range(args.runs)]
    for i, (per_step, per_request, done, by_thread) in enumerate(results, 1):
        threads = ", ".join(f"{name} {us:.0f}" for name, us in sorted(by_thread.items(), key=lambda kv: -kv[1]) if us >= 0.5)
        print(f"run {i}: {per_step * 1e3:.0f} µs CPU per output, {per_request:.2f} ms per request ({done} requests); "
              f"µs per output by thread: {threads}")
    print(f"median: {statistics.median(r[0] for r in results) * 1e3:.0f} µs per output, "
          f"{statistics.median(r[1] for r in results):.2f} ms per {TOKENS}-token request, c={args.concurrency}")


if __name__ == "__main__":
    main()

"""CPU per message of reading an ingress replica's output link: pyzmq's asyncio socket against
`LinkInbox` (a blocking receive in a thread of its own, handed to the event loop).

    .venv/bin/python bench/inbox_bench.py [--messages 2000] [--runs 3]

A sender subprocess pushes 300-byte messages every 2 ms (an engine step at one stream) to a PULL
socket that this process reads on uvloop, as Ray's workers run their loop; this process's CPU time
(all threads, zmq's I/O thread included) from the first message to the last, per message. The two
readers one after the other, `--runs` times. Not a test; run it alone on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import uvloop  # noqa: E402
import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402

from mmserve.transit.sockets import LinkInbox  # noqa: E402

SENDER = """
import sys, time, zmq
sock = zmq.Context.instance().socket(zmq.PUSH)
sock.connect(sys.argv[1])
time.sleep(0.3)
for _ in range(int(sys.argv[2])):
    sock.send(b"x" * 300)
    time.sleep(float(sys.argv[3]))
sock.send(b"end")
time.sleep(0.2)
"""


class AsyncioSocketReader:
    """The reader `LinkInbox` replaced: `await` on pyzmq's asyncio PULL socket."""

    def __init__(self) -> None:
        self._socket = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"

    async def recv(self) -> bytes:
        return await self._socket.recv(copy=True)

    def close(self) -> None:
        self._socket.close(linger=0)


def busy(seconds: float) -> None:
    """The loop's own work per message (an ingress detokenizing and writing SSE), on the CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def cpu_per_message(make_reader, messages: int, work_s: float = 0.0, interval_ms: float = 2.0) -> float:
    reader = make_reader()
    sender = subprocess.Popen([sys.executable, "-c", SENDER, reader.address, str(messages), str(interval_ms / 1e3)])
    try:
        await reader.recv()
        cpu0, count = time.process_time(), 1
        while await reader.recv() != b"end":
            count += 1
            if work_s:
                busy(work_s)
        return (time.process_time() - cpu0) / count - work_s
    finally:
        reader.close()
        sender.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work-ms", type=float, default=0.0, help="CPU the loop spends per message (a busy ingress)")
    parser.add_argument("--interval-ms", type=float, default=2.0, help="the sender's pause between messages")
    args = parser.parse_args()
    results: dict[str, list[float]] = {"pyzmq asyncio socket": [], "LinkInbox (thread)": []}
    for _ in range(args.runs):
        for name, reader in zip(results, (AsyncioSocketReader, lambda: LinkInbox("127.0.0.1"))):
            results[name].append(uvloop.run(cpu_per_message(reader, args.messages, args.work_ms / 1e3, args.interval_ms)))
    for name, values in results.items():
        print(f"{name:22s} median {statistics.median(values) * 1e6:4.0f} µs CPU per message "
              f"(runs: {', '.join(f'{v * 1e6:.0f}' for v in values)})")


if __name__ == "__main__":
    main()

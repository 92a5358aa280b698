"""A load client light enough to share a core with the engine stand-in: streamed chat completions over
raw asyncio HTTP/1.1 keep-alive connections, each answer's chunks timed without parsing their JSON.

A content chunk is told by its bytes (`"content":"` followed by something), the final usage chunk is
the one JSON parsed; so a chunk costs the client a few byte searches, not a `json.loads`, and a
closed loop of hundreds of streams fits beside the stand-in on one core. Both front ends answer SSE
with chunked transfer encoding (uvicorn for vLLM, HAProxy and uvicorn for mmserve); a body with a
Content-Length is read whole.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

CONTENT = b'"content":"'
USAGE = b'"usage":{'


@dataclass
class Answer:
    """One streamed request as the client saw it (times from `time.perf_counter()`)."""

    sent: float
    status: int = 0
    error: str | None = None
    first: float | None = None  # first chunk carrying content
    last: float | None = None
    chunks: int = 0
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    done: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.first is not None and self.completion_tokens is not None

    @property
    def ttft(self) -> float:
        assert self.first is not None
        return self.first - self.sent

    @property
    def tpot(self) -> float | None:
        n = self.completion_tokens or 0
        if n < 2 or self.first is None or self.last is None:
            return None
        return (self.last - self.first) / (n - 1)


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


@dataclass
class Client:
    """Streamed POSTs to one URL over a pool of keep-alive connections."""

    url: str
    timeout_s: float = 300.0
    _idle: list[_Connection] = field(default_factory=list)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        self._host, self._port, self._path = parts.hostname or "127.0.0.1", parts.port or 80, parts.path or "/"

    async def _connection(self) -> _Connection:
        if self._idle:
            return self._idle.pop()
        reader, writer = await asyncio.open_connection(self._host, self._port, limit=1 << 20)
        return _Connection(reader, writer)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def post(self, body: bytes) -> Answer:
        answer = Answer(sent=time.perf_counter())
        conn: _Connection | None = None
        try:
            conn = await self._connection()
            head = (f"POST {self._path} HTTP/1.1\r\nHost: {self._host}:{self._port}\r\nContent-Type: application/json\r\n"
                    f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            conn.writer.write(head + body)
            keep = await asyncio.wait_for(self._read_response(conn, answer), self.timeout_s)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as exc:
            answer.error = f"{type(exc).__name__}: {exc}"
            keep = False
        answer.done = time.perf_counter()
        if conn is not None:
            if keep:
                self._idle.append(conn)
            else:
                conn.close()
        return answer

    async def _read_response(self, conn: _Connection, answer: Answer) -> bool:
        """Reads one response into `answer`; whether the connection can be used again."""
        reader = conn.reader
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionResetError("connection closed before the response")
        answer.status = int(status_line.split(b" ", 2)[1])
        chunked, length, keep = False, None, True
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"transfer-encoding" and b"chunked" in value:
                chunked = True
            elif name == b"content-length":
                length = int(value)
            elif name == b"connection" and value == b"close":
                keep = False
        pending = b""
        if chunked:
            while True:
                size = int((await reader.readline()).split(b";", 1)[0], 16)
                if size == 0:
                    await reader.readline()
                    break
                data = await reader.readexactly(size + 2)
                pending = self._events(pending + data[:-2], answer)
        else:
            pending = self._events(await reader.readexactly(length or 0) if length is not None else await reader.read(), answer)
            keep = keep and length is not None
        if pending.strip():
            self._events(pending + b"\n\n", answer)
        if answer.status != 200 and answer.error is None:
            answer.error = f"HTTP {answer.status}"
        return keep

    @staticmethod
    def _events(data: bytes, answer: Answer) -> bytes:
        """Takes the complete SSE events off `data`; returns the incomplete rest."""
        now = time.perf_counter()
        *events, rest = data.split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                if event.startswith(b"{"):  # a whole JSON body (an error answer)
                    answer.error = event[:200].decode(errors="replace")
                continue
            at = event.find(CONTENT)
            if at >= 0 and event[at + len(CONTENT):at + len(CONTENT) + 1] != b'"':
                answer.chunks += 1
                answer.last = now
                if answer.first is None:
                    answer.first = now
            if USAGE in event:
                body: dict[str, Any] = json.loads(event[6:])
                usage = body.get("usage") or {}
                answer.completion_tokens = usage.get("completion_tokens")
                answer.prompt_tokens = usage.get("prompt_tokens")
            elif b'"error"' in event[:20]:
                answer.error = event[6:206].decode(errors="replace")
        return rest


async def closed_loop(url: str, bodies: list[bytes], concurrency: int, seconds: float) -> tuple[list[Answer], float]:
    """`concurrency` workers sending `bodies` in turn (cycling) back to back for `seconds`; answers of the
    requests sent in that time (those in flight at its end finish) and the wall time until the last ended."""
    client = Client(url)
    answers: list[Answer] = []
    start = time.perf_counter()
    stop = start + seconds
    next_body = iter(range(1 << 62))

    async def worker() -> None:
        while time.perf_counter() < stop:
            answers.append(await client.post(bodies[next(next_body) % len(bodies)]))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    client.close()
    return answers, time.perf_counter() - start


async def poisson(url: str, bodies: list[bytes], rate: float, seconds: float, seed: int) -> tuple[list[Answer], float]:
    """Requests at exponentially distributed gaps of mean 1/`rate` for `seconds` (open loop: a request is
    sent at its time whether or not the earlier ones were answered)."""
    client = Client(url)
    rng = random.Random(seed)
    tasks: list[asyncio.Task[Answer]] = []
    start = time.perf_counter()
    at = start
    i = 0
    while True:
        at += rng.expovariate(rate)
        if at >= start + seconds:
            break
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(client.post(bodies[i % len(bodies)])))
        i += 1
    answers = list(await asyncio.gather(*tasks))
    client.close()
    return answers, time.perf_counter() - start

"""A preprocessor replica's end of the preprocessing link: jobs in at its inbox, answers out to each sender's.

The replica binds one inbox (`zmq_link.LinkInbox`) for its life. A sender (an engine client) first
attaches, naming its own inbox (a Serve call that stays open as long as the sender uses this
replica: `PreprocessorDeployment.subscribe`), then sends `PreprocessJob`s and `CancelJobs` here;
each job runs as a task of its own and its answer leaves at once, its pixels written to the pixel
store and held there until the sender has mapped them (`ReleasePixels`), cancelled the job, or
detached, and never longer than `PIXEL_HOLD_S` (`preprocessing_link.py`). A sender that detaches (it
stopped using the replica, or died) takes its jobs and their pixels with it. Ray does not end a streaming call whose caller died: the replica looks its engine
clients up by actor name and ends the attachment of one found dead (about a second later,
`deployments/caller_watch.HeldCalls`); until then no answers are kept for it: answers are sent only
while its inbox is connected.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import zmq

from ..multimodal.types import ImageBatchRequest, ImagesRefused, ProcessedImages
from .sockets import LinkInbox, LinkOutbox
from .preprocessing_link import (
    AskHeldJobs, CancelJobs, PixelStore, PreprocessJob, ReleasePixels, decode_message, encode_answer, encode_not_held,
)

logger = logging.getLogger("ray.serve")

# An answer whose sender's inbox is not connected is tried again this often, this many times (5 s),
# then dropped: a sender that died leaves no answers queued for it (before the replica finds it dead).
UNDELIVERED_RETRY_S = 0.05
UNDELIVERED_TRIES = 100
# Pixels whose sender has not released them this long after their answer left are let go (logged):
# a sender maps them within milliseconds; one that reads them later finds them gone and tries again.
PIXEL_HOLD_S = 30.0

Process = Callable[[ImageBatchRequest], Awaitable[ProcessedImages | ImagesRefused]]


class PreprocessingServer:
    """Runs `process` for the jobs arriving at its inbox, bound on `host`, their pixels written to
    `store`; `in_flight` counts the jobs it holds (the replica's load, link and Serve calls together,
    is its `ReplicaAdmission`'s), `pixels_held` the answers whose pixels it holds."""

    def __init__(self, process: Process, host: str, store: PixelStore, pixel_hold_s: float = PIXEL_HOLD_S) -> None:
        self._process = process
        self._store = store
        self._pixel_hold_s = pixel_hold_s
        self._inbox = LinkInbox(host, name="preprocessor-inbox")
        self.address = self._inbox.address
        self._senders: dict[str, LinkOutbox] = {}
        self._jobs: dict[tuple[str, int], asyncio.Task[None]] = {}
        # Jobs answered whose answers wait for their sender's inbox to be connected again.
        self._delivering: set[tuple[str, int]] = set()
        # Answered jobs' holds on their pixels in the store, and when each answer left (the loop's clock).
        self._held: dict[tuple[str, int], tuple[Any, float]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    @property
    def pixels_held(self) -> int:
        return len(self._held)

    def attach(self, reply_to: str) -> None:
        """Answer jobs from the sender whose inbox is `reply_to` (starts reading on the first)."""
        if self._reader is None:
            # Its own context: not the context of the Serve call that happened to attach first.
            self._reader = asyncio.get_running_loop().create_task(self._read(), name="preprocessor-inbox", context=contextvars.Context())
        if reply_to not in self._senders:
            self._senders[reply_to] = LinkOutbox(reply_to, connected_only=True)

    def detach(self, reply_to: str) -> None:
        """The sender is gone or done with this replica: cancel its jobs, let its pixels go, close the way to it."""
        for key in [key for key in self._jobs if key[0] == reply_to]:
            self._jobs.pop(key).cancel()
        for key in [key for key in self._held if key[0] == reply_to]:
            del self._held[key]
        if (outbox := self._senders.pop(reply_to, None)) is not None:
            outbox.close()

    def close(self) -> None:
        for reply_to in list(self._senders):
            self.detach(reply_to)
        for task in (self._reader, self._sweeper):
            if task is not None:
                task.cancel()
        self._held.clear()
        self._inbox.close()

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await self._inbox.recv()
            try:
                message = decode_message(data)
            except msgspec.DecodeError as exc:
                logger.warning("preprocessor: an unreadable message on its inbox (%d bytes): %s", len(data), exc)
                continue
            if isinstance(message, CancelJobs):
                for job in message.jobs:
                    if (task := self._jobs.pop((message.reply_to, job), None)) is not None:
                        task.cancel()
                    self._held.pop((message.reply_to, job), None)  # (answered as it was cancelled)
            elif isinstance(message, ReleasePixels):
                for job in message.jobs:
                    self._held.pop((message.reply_to, job), None)
            elif isinstance(message, AskHeldJobs):
                self._answer_held(message)
            elif message.reply_to not in self._senders:
                # Detached meanwhile (its Serve call ended): nobody waits for the answer.
                logger.info("preprocessor: job %d from a sender no longer attached, dropped", message.job)
            else:
                key = (message.reply_to, message.job)
                self._jobs[key] = loop.create_task(self._run(message), name="preprocessor-job", context=contextvars.Context())

    async def _run(self, message: PreprocessJob) -> None:
        key = (message.reply_to, message.job)
        try:
            answer = await self._process(message.request)
        except Exception as exc:  # the preprocessor's own bug: logged here, a 503 for the client
            logger.exception("preprocessor: job %d failed", message.job)
            answer = ImagesRefused(f"image preprocessing failed: {type(exc).__name__}; retry shortly", kind="busy", retry_after_s=1)
        finally:
            self._jobs.pop(key, None)
        if message.reply_to not in self._senders:
            return  # detached meanwhile: nobody waits for it (its pixels are not written)
        data, hold = encode_answer(message.job, answer, self._store.put)
        if hold is not None:
            self._held[key] = (hold, asyncio.get_running_loop().time())
            if self._sweeper is None:
                self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="pixel-holds", context=contextvars.Context())
        self._delivering.add(key)
        try:
            for _ in range(UNDELIVERED_TRIES):
                if (outbox := self._senders.get(message.reply_to)) is None:
                    return  # detached meanwhile: nobody waits for it
                try:
                    outbox.send_nowait(data)
                    return
                except zmq.Again:  # not connected: the sender died, or its connection is being remade
                    await asyncio.sleep(UNDELIVERED_RETRY_S)
        finally:
            self._delivering.discard(key)
        self._held.pop(key, None)
        logger.warning("preprocessor: the answer to job %d could not be delivered to %s for %.0f s: dropped",
                       message.job, message.reply_to, UNDELIVERED_TRIES * UNDELIVERED_RETRY_S)

    async def _sweep(self) -> None:
        """Let go of pixels held past `pixel_hold_s` (their release lost, or their sender stuck)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._pixel_hold_s / 4)
            before = loop.time() - self._pixel_hold_s
            if expired := [key for key, (_, since) in self._held.items() if since <= before]:
                for key in expired:
                    del self._held[key]
                logger.warning("preprocessor: pixels of %d answers not released within %.0f s, let go", len(expired), self._pixel_hold_s)

    def _answer_held(self, message: AskHeldJobs) -> None:
        """Tell the sender which of its jobs asked about are held nowhere here (it fails them)."""
        if (outbox := self._senders.get(message.reply_to)) is None:
            return  # detached: its jobs went with it, and it knows
        not_held = [job for job in message.jobs if (key := (message.reply_to, job)) not in self._jobs and key not in self._delivering]
        try:
            outbox.send_nowait(encode_not_held(not_held))
        except zmq.Again:
            pass  # not connected now: it asks again

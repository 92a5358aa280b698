"""A preprocessor replica's end of the preprocessing link: jobs in at its inbox, answers out to each sender's.

The replica binds one inbox (`sockets.LinkInbox`) for its life. A sender (an engine client) first
attaches, naming its own inbox (a Serve call that stays open as long as the sender uses this
replica: `PreprocessorDeployment.subscribe`), then sends `PreprocessJob`s here; each job runs as a
task of its own and its answer leaves at once, its pixels written to the pixel store and held there
until the sender has mapped them (`ReleasePixels`), cancelled the job, or detached, and never longer
than `PIXEL_HOLD_S` (`preprocessing_link.py`). A sender that detaches (it stopped using the replica,
or died) takes its jobs and their pixels with it.

Every message is numbered (`sockets.Arrivals`): a message from a sender found lost drops all that
sender's jobs and pixels here, and says so (`JobAnswer.lost`), for the sender to fail and try them
again; a probe is answered at once. An answer whose sender's inbox is not connected is tried again
for a while, then given up, its number skipped so that the sender finds it lost. Ray does not end a
streaming call whose caller died: the replica looks its engine clients up by actor name and ends
the attachment of one found dead (about a second later, `deployments/caller_watch.HeldCalls`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import zmq

from ..multimodal.types import ImageBatchRequest, ProcessedImages
from .preprocessing_link import (
    CancelJobs, JobAnswer, PixelStore, PreprocessJob, Probe, answer_of, decode_message, encode,
)
from .refusals import Refusal
from .sockets import Arrivals, LinkInbox, LinkOutbox

logger = logging.getLogger("ray.serve")

# An answer whose sender's inbox is not connected is tried again this often, this many times (5 s),
# then given up: a sender that died leaves no answers queued for it (before the replica finds it dead).
UNDELIVERED_RETRY_S = 0.05
UNDELIVERED_TRIES = 100
# Pixels whose sender has not released them this long after their answer left are let go (logged):
# a sender maps them within milliseconds; one that reads them later finds them gone and tries again.
PIXEL_HOLD_S = 30.0

Process = Callable[[ImageBatchRequest], Awaitable[ProcessedImages | Refusal]]


class PreprocessingServer:
    """Runs `process` for the jobs arriving at its inbox, bound on `host`, their pixels written to
    `store`; `in_flight` counts the jobs it holds (the replica's load is its `ReplicaAdmission`'s),
    `pixels_held` the answers whose pixels it holds."""

    def __init__(self, process: Process, host: str, store: PixelStore, pixel_hold_s: float = PIXEL_HOLD_S) -> None:
        self._process = process
        self._store = store
        self._pixel_hold_s = pixel_hold_s
        self._inbox = LinkInbox(host, name="preprocessor-inbox")
        self.address = self._inbox.address
        self._senders: dict[str, LinkOutbox] = {}
        self._arrivals = Arrivals()
        self._jobs: dict[tuple[str, int], asyncio.Task[None]] = {}
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
        """The sender is gone or done with this replica: its jobs and pixels go, the way to it closes."""
        self._drop(reply_to)
        self._arrivals.forget(reply_to)
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

    def _drop(self, reply_to: str) -> None:
        """Cancel every job of `reply_to`'s, and let its pixels go."""
        for key in [key for key in self._jobs if key[0] == reply_to]:
            self._jobs.pop(key).cancel()
        for key in [key for key in self._held if key[0] == reply_to]:
            del self._held[key]

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await self._inbox.recv()
            try:
                message = decode_message(data)
            except msgspec.DecodeError as exc:
                logger.warning("preprocessor: an unreadable message on its inbox (%d bytes): %s", len(data), exc)
                continue
            reply_to = message.reply_to
            if reply_to not in self._senders:
                # Detached meanwhile (its Serve call ended): nobody waits for an answer.
                logger.info("preprocessor: a message from a sender no longer attached, dropped")
                continue
            if self._arrivals.lost(reply_to, message):
                logger.warning("preprocessor: messages from %s were lost on the way: dropping its jobs", reply_to)
                self._drop(reply_to)
                self._send(reply_to, JobAnswer(sender=self.address, job=0, lost=True))
            if isinstance(message, PreprocessJob):
                key = (reply_to, message.job)
                self._jobs[key] = loop.create_task(self._run(message), name="preprocessor-job", context=contextvars.Context())
            elif isinstance(message, Probe):
                self._send(reply_to, JobAnswer(sender=self.address, job=0))
            else:  # CancelJobs (also of a job answered as it was cancelled), ReleasePixels
                for job in message.jobs:
                    if isinstance(message, CancelJobs) and (task := self._jobs.pop((reply_to, job), None)) is not None:
                        task.cancel()
                    self._held.pop((reply_to, job), None)

    def _send(self, reply_to: str, message: JobAnswer) -> bool:
        """Send now if the sender's inbox is connected (False: not now)."""
        if (outbox := self._senders.get(reply_to)) is None:
            return True  # detached: nobody waits for it
        try:
            outbox.send(message, encode)
        except zmq.Again:  # not connected: the sender died, or its connection is being remade
            return False
        return True

    async def _run(self, message: PreprocessJob) -> None:
        key = (message.reply_to, message.job)
        try:
            answer = await self._process(message.request)
        except Exception as exc:  # the preprocessor's own bug: logged here, a 500 for the client
            logger.exception("preprocessor: job %d failed", message.job)
            answer = Refusal("internal", f"image preprocessing failed: {type(exc).__name__}")
        finally:
            self._jobs.pop(key, None)
        if message.reply_to not in self._senders:
            return  # detached meanwhile: nobody waits for it (its pixels are not written)
        reply, hold = answer_of(self.address, message.job, answer, self._store.put)
        if hold is not None:
            self._held[key] = (hold, asyncio.get_running_loop().time())
            if self._sweeper is None:
                self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="pixel-holds", context=contextvars.Context())
        for _ in range(UNDELIVERED_TRIES):
            if self._send(message.reply_to, reply):
                return
            await asyncio.sleep(UNDELIVERED_RETRY_S)
        self._held.pop(key, None)
        if (outbox := self._senders.get(message.reply_to)) is not None:
            outbox.skip()  # (the sender finds the answer lost by its number)
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

"""An engine client's end of the preprocessing link: jobs to the preprocessor replicas, answers back at its own inbox.

The engine client binds one inbox for answers (their pixels named in the pixel store, mapped from
there and then released to the replica: `preprocessing_link.py`) and knows, per preprocessor
deployment, the replicas it is attached to (`PreprocessorReplicas`: the Ray side,
`deployments/preprocessor_calls.py`, attaches and detaches them as Serve's replica list changes). A
job waits for a replica to be attached (bounded), then goes to the attached replica with the fewest
of this client's jobs; the replica itself admits, queues or refuses it (`replica_admission.py`).
One being taken away (scaled down) gets no new jobs and is detached once its jobs have answered.

A job fails with `LinkLost`, for the caller to try once more, when its replica is lost (its
attachment ended), when its pixels cannot be read, or when a message either way between this client
and its replica was lost: found by their numbers (`sockets.Arrivals`), here or at the replica, which
says so (`JobAnswer.lost`); with jobs waiting and nothing heard from a replica for
`sockets.LINK_PROBE_S`, this client probes it.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
from collections.abc import Callable

from ..multimodal.types import ImageBatchRequest, ProcessedImages
from .preprocessing_link import (
    AnswerError, AnswerHead, CancelJobs, PixelStore, PreprocessJob, Probe, ReleasePixels, decode_answer, decode_head, encode,
)
from .refusals import LinkLost, Refusal, busy
from .sockets import LINK_PROBE_S, Arrivals, LinkInbox, LinkOutbox

logger = logging.getLogger("ray.serve")

# An answer as it arrived, and what was read of it before its pixels.
Arrived = tuple[bytes, AnswerHead]


class AttachedReplica:
    """One preprocessor replica as this engine client sends it jobs."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.outbox = LinkOutbox(address)
        self.jobs: dict[int, asyncio.Future[Arrived]] = {}
        self.leaving = False
        # When this client last heard from the replica (the loop's clock).
        self.heard_at = asyncio.get_running_loop().time()

    def fail(self, error: LinkLost) -> None:
        for answer in self.jobs.values():
            if not answer.done():
                answer.set_exception(error)


class PreprocessingInbox:
    """Where every replica's answers to this engine client arrive, matched to their jobs; their pixels
    are read from `store`. `replicas` maps each replica's inbox address to its attachment."""

    def __init__(self, host: str, store: PixelStore) -> None:
        self._inbox = LinkInbox(host, name="preprocessing-answers")
        self.address = self._inbox.address
        self.store = store
        self.replicas: dict[str, AttachedReplica] = {}
        self._arrivals = Arrivals()
        self._jobs = itertools.count(1)
        self._reader: asyncio.Task[None] | None = None

    def next_job(self) -> int:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read(), name="preprocessing-answers", context=contextvars.Context())
        return next(self._jobs)

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await self._inbox.recv()
            try:
                head = decode_head(data)
            except AnswerError as exc:
                logger.warning("engine client: an unreadable preprocessing answer (%d bytes): %s", len(data), exc)
                continue
            attached = self.replicas.get(head.sender)
            if attached is None:
                continue  # a replica since let go: nothing of its waits here
            attached.heard_at = loop.time()
            if self._arrivals.lost(head.sender, head) or head.lost:
                self.lost(attached, f"messages between this engine client and preprocessor replica {head.sender} were lost")
            if head.job and (answer := attached.jobs.get(head.job)) is not None and not answer.done():
                answer.set_result((data, head))

    def lost(self, attached: AttachedReplica, why: str) -> None:
        """Messages with `attached` were lost: every job there fails, and the replica drops them."""
        logger.warning("engine client: %s; failing its %d jobs there", why, len(attached.jobs))
        if attached.jobs and not attached.outbox.closed:
            attached.outbox.send(CancelJobs(self.address, list(attached.jobs)), encode)
        attached.fail(LinkLost(why))

    def forget(self, address: str) -> None:
        self.replicas.pop(address, None)
        self._arrivals.forget(address)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._inbox.close()


class PreprocessorReplicas:
    """One preprocessor deployment's replicas this engine client is attached to. `detached(replica)`
    is called when a leaving replica's last job has answered (the Ray side then ends its attachment)."""

    def __init__(self, inbox: PreprocessingInbox, detached: Callable[[str], None], probe_s: float = LINK_PROBE_S) -> None:
        self._inbox = inbox
        self._detached = detached
        self._replicas: dict[str, AttachedReplica] = {}
        self._probe_s = probe_s
        self._prober: asyncio.Task[None] | None = None
        # Set while a replica takes new jobs.
        self._open = asyncio.Event()

    def __contains__(self, replica: str) -> bool:
        return replica in self._replicas

    def attach(self, replica: str, address: str) -> None:
        if replica not in self._replicas:
            self._replicas[replica] = self._inbox.replicas[address] = AttachedReplica(address)
            self._opened()

    def leave(self, replica: str) -> None:
        """No new jobs for `replica`; detached once its jobs have answered."""
        if (attached := self._replicas.get(replica)) is not None:
            attached.leaving = True
            self._opened()
            self._detach_if_done(replica, attached)

    def lost(self, replica: str) -> None:
        """The replica is gone: its jobs fail with `LinkLost`."""
        attached = self._replicas.pop(replica, None)
        if attached is None:
            return
        self._opened()
        self._inbox.forget(attached.address)
        attached.fail(LinkLost(f"preprocessor replica {replica} was lost"))
        attached.outbox.close()

    async def process(self, request: ImageBatchRequest, attach_timeout_s: float) -> ProcessedImages | Refusal:
        """The request's images, from the attached replica with the fewest of these jobs (waiting up
        to `attach_timeout_s` for one to be attached: "busy" if none is)."""
        while not (candidates := [(len(r.jobs), name) for name, r in self._replicas.items() if not r.leaving]):
            try:
                await asyncio.wait_for(self._open.wait(), attach_timeout_s)
            except TimeoutError:
                return busy(f"no image preprocessor replica could be reached within {attach_timeout_s:.0f} s")
        replica = min(candidates)[1]
        attached = self._replicas[replica]
        job = self._inbox.next_job()
        answer = attached.jobs[job] = asyncio.get_running_loop().create_future()
        attached.outbox.send(PreprocessJob(self._inbox.address, job, request), encode)
        if self._prober is None:
            self._prober = asyncio.get_running_loop().create_task(self._probe(), name="preprocessing-probe", context=contextvars.Context())
        try:
            data, head = await answer
            return await self._read(data, head, job, attached)
        except asyncio.CancelledError:
            # (Cancelling this task cancels the future it awaits: `answer` has no result then. The
            # replica lets the job's pixels go if it answered meanwhile.)
            if (answer.cancelled() or not answer.done()) and self._replicas.get(replica) is attached:
                attached.outbox.send(CancelJobs(self._inbox.address, [job]), encode)
            raise
        finally:
            if attached.jobs.pop(job, None) is not None:
                self._detach_if_done(replica, attached)

    async def _read(self, data: bytes, head: AnswerHead, job: int, attached: AttachedReplica) -> ProcessedImages | Refusal:
        """The answer, its pixels mapped from the store and then released (the mapping keeps them)."""
        stored: list = []
        if head.pixels is not None:
            try:
                stored = await self._inbox.store.get(head.pixels)
            except LinkLost as exc:
                raise LinkLost(f"the pixels of job {job} were lost: {exc}") from None
            finally:
                if not attached.outbox.closed:
                    attached.outbox.send(ReleasePixels(self._inbox.address, [job]), encode)
        try:
            return decode_answer(data, stored).answer
        except AnswerError as exc:
            raise LinkLost(f"the answer to job {job} could not be read: {exc}") from None

    def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()

    async def _probe(self) -> None:
        """Every `probe_s`, probe each replica with jobs here that has been silent that long."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._probe_s)
            for attached in list(self._replicas.values()):
                if attached.jobs and loop.time() - attached.heard_at >= self._probe_s and not attached.outbox.closed:
                    attached.outbox.send(Probe(self._inbox.address), encode)

    def _opened(self) -> None:
        if any(not attached.leaving for attached in self._replicas.values()):
            self._open.set()
        else:
            self._open.clear()

    def _detach_if_done(self, replica: str, attached: AttachedReplica) -> None:
        if attached.leaving and not attached.jobs and self._replicas.get(replica) is attached:
            del self._replicas[replica]
            self._opened()
            self._inbox.forget(attached.address)
            attached.outbox.close()
            self._detached(replica)

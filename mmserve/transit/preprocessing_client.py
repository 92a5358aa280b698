"""An engine client's end of the preprocessing link: jobs to the preprocessor replicas, answers back at its own inbox.

The engine client binds one inbox for answers (their pixels named in the pixel store, mapped from
there and then released to the replica: `preprocessing_link.py`) and knows,
per preprocessor deployment, the replicas it is attached to (`PreprocessorReplicas`: the Ray side,
`deployments/preprocessor_calls.py`, attaches and detaches them as Serve's replica list changes). A
job goes to the attached replica with the fewest of this client's jobs; the replica itself admits,
queues or refuses it (`replica_admission.py`). A replica lost under a job fails it (`ReplicaLost`),
for the caller to try once more, and so does a job the replica says it does not hold: asked of the
jobs unanswered after `JOB_CHECK_S` (every `JOB_CHECK_S`), which finds the ones whose message or
answer a broken connection lost (ZMQ remakes the connection; what was on its way is gone). One
being taken away (scaled down) gets no new jobs and is detached once its jobs have answered.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
from collections.abc import Callable

from ..multimodal.types import ImageBatchRequest, ImagesRefused, ProcessedImages
from .sockets import LinkInbox, LinkOutbox
from .preprocessing_link import (
    AnswerError, AnswerHead, AskHeldJobs, CancelJobs, PixelsLost, PixelStore, PreprocessJob, ReleasePixels, decode_answer,
    decode_head, encode_message,
)

logger = logging.getLogger("ray.serve")

# Jobs unanswered this long are asked after (`AskHeldJobs`), this often: a job takes well under a
# second, or waits its turn at a replica that holds it.
JOB_CHECK_S = 10.0


class ReplicaLost(Exception):
    """The preprocessor replica doing a job was lost (died, or stopped) before it answered."""


class NoReplicaAttached(Exception):
    """No replica of the deployment is attached (none yet, or none is left): wait for one (`attached`)."""


# An answer as it arrived, and what was read of it before its pixels.
Arrived = tuple[bytes, AnswerHead]


class PreprocessingInbox:
    """Where every replica's answers to this engine client arrive, matched to their jobs; their pixels
    are read from `store`."""

    def __init__(self, host: str, store: PixelStore) -> None:
        self._inbox = LinkInbox(host, name="preprocessing-answers")
        self.address = self._inbox.address
        self.store = store
        self._jobs = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Arrived]] = {}
        self._reader: asyncio.Task[None] | None = None

    def expect(self) -> tuple[int, asyncio.Future[Arrived]]:
        """A new job's id and the future its answer will resolve."""
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read(), name="preprocessing-answers", context=contextvars.Context())
        job = next(self._jobs)
        answer = self._waiting[job] = asyncio.get_running_loop().create_future()
        return job, answer

    def forget(self, job: int) -> None:
        self._waiting.pop(job, None)

    async def _read(self) -> None:
        while True:
            data = await self._inbox.recv()
            try:
                head = decode_head(data)
            except AnswerError as exc:
                logger.warning("engine client: an unreadable preprocessing answer (%d bytes): %s", len(data), exc)
                continue
            if head.not_held is not None:
                for job in head.not_held:
                    future = self._waiting.pop(job, None)
                    if future is not None and not future.done():
                        future.set_exception(ReplicaLost(f"the preprocessor replica does not hold job {job}: its message or answer was lost"))
                continue
            future = self._waiting.pop(head.job, None)
            if future is not None and not future.done():
                future.set_result((data, head))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._inbox.close()


class AttachedReplica:
    """One preprocessor replica as this engine client sends it jobs."""

    def __init__(self, address: str) -> None:
        self.outbox = LinkOutbox(address)
        self.jobs: dict[int, asyncio.Future[Arrived]] = {}
        # When each job was sent (the loop's clock).
        self.sent: dict[int, float] = {}
        self.leaving = False


class PreprocessorReplicas:
    """One preprocessor deployment's replicas this engine client is attached to. `detached(replica)`
    is called when a leaving replica's last job has answered (the Ray side then ends its attachment)."""

    def __init__(self, inbox: PreprocessingInbox, detached: Callable[[str], None], job_check_s: float = JOB_CHECK_S) -> None:
        self._inbox = inbox
        self._detached = detached
        self._replicas: dict[str, AttachedReplica] = {}
        self._job_check_s = job_check_s
        self._checker: asyncio.Task[None] | None = None
        # Set while a replica takes new jobs.
        self._open = asyncio.Event()

    def __contains__(self, replica: str) -> bool:
        return replica in self._replicas

    async def attached(self) -> None:
        """Return once a replica takes new jobs (at once if one does)."""
        await self._open.wait()

    def attach(self, replica: str, address: str) -> None:
        if replica not in self._replicas:
            self._replicas[replica] = AttachedReplica(address)
            self._opened()

    def leave(self, replica: str) -> None:
        """No new jobs for `replica`; detached once its jobs have answered."""
        if (attached := self._replicas.get(replica)) is not None:
            attached.leaving = True
            self._opened()
            self._detach_if_done(replica, attached)

    def lost(self, replica: str) -> None:
        """The replica is gone: its jobs fail with `ReplicaLost`."""
        attached = self._replicas.pop(replica, None)
        if attached is None:
            return
        self._opened()
        for job, answer in attached.jobs.items():
            self._inbox.forget(job)
            if not answer.done():
                answer.set_exception(ReplicaLost(f"preprocessor replica {replica} was lost"))
        attached.outbox.close()

    def _opened(self) -> None:
        if any(not attached.leaving for attached in self._replicas.values()):
            self._open.set()
        else:
            self._open.clear()

    async def process(self, request: ImageBatchRequest) -> ProcessedImages | ImagesRefused:
        """The request's images, from the attached replica with the fewest of these jobs."""
        candidates = [(len(r.jobs), name) for name, r in self._replicas.items() if not r.leaving]
        if not candidates:
            raise NoReplicaAttached()
        replica = min(candidates)[1]
        attached = self._replicas[replica]
        job, answer = self._inbox.expect()
        attached.jobs[job] = answer
        attached.outbox.send_nowait(encode_message(PreprocessJob(self._inbox.address, job, request)))
        attached.sent[job] = asyncio.get_running_loop().time()
        if self._checker is None:
            self._checker = asyncio.get_running_loop().create_task(self._check_jobs(), name="preprocessing-job-check", context=contextvars.Context())
        try:
            data, head = await answer
            return await self._read(data, head, job, attached)
        except asyncio.CancelledError:
            # (Cancelling this task cancels the future it awaits: `answer` has no result then. The
            # replica lets the job's pixels go if it answered meanwhile.)
            if (answer.cancelled() or not answer.done()) and self._replicas.get(replica) is attached:
                attached.outbox.send_nowait(encode_message(CancelJobs(self._inbox.address, [job])))
            raise
        finally:
            self._inbox.forget(job)
            attached.sent.pop(job, None)
            if attached.jobs.pop(job, None) is not None:
                self._detach_if_done(replica, attached)

    async def _read(self, data: bytes, head: AnswerHead, job: int, attached: AttachedReplica) -> ProcessedImages | ImagesRefused:
        """The answer, its pixels mapped from the store and then released (the mapping keeps them)."""
        stored: list = []
        if head.pixels is not None:
            try:
                stored = await self._inbox.store.get(head.pixels)
            except PixelsLost as exc:
                raise ReplicaLost(f"the pixels of job {job} were lost: {exc}") from None
            finally:
                if not attached.outbox.closed:
                    attached.outbox.send_nowait(encode_message(ReleasePixels(self._inbox.address, [job])))
        try:
            return decode_answer(data, stored).answer
        except AnswerError as exc:
            raise ReplicaLost(f"the answer to job {job} could not be read: {exc}") from None

    def close(self) -> None:
        if self._checker is not None:
            self._checker.cancel()

    async def _check_jobs(self) -> None:
        """Every `job_check_s`, ask each replica whether it holds this client's jobs sent that long ago."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._job_check_s)
            before = loop.time() - self._job_check_s
            for attached in list(self._replicas.values()):
                if old := [job for job, sent in attached.sent.items() if sent <= before]:
                    attached.outbox.send_nowait(encode_message(AskHeldJobs(self._inbox.address, old)))

    def _detach_if_done(self, replica: str, attached: AttachedReplica) -> None:
        if attached.leaving and not attached.jobs and self._replicas.get(replica) is attached:
            del self._replicas[replica]
            self._opened()
            attached.outbox.close()
            self._detached(replica)

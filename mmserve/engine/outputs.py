"""Where an engine's outputs go: a sink per request, or one channel merging many requests for one caller.

`EngineClient.add` hands each request's outputs to an `OutputSink`. `RequestStream` is the sink of
one request read as an iterator (`EngineClient.generate`). `CallerChannel` is the sink of every
request one caller (an ingress replica) sent: outputs (and the answers to the caller's requests,
opaque here) accumulate in it until the caller takes them all at once, so a caller that lags is handed one merged batch instead of one item per
output and request, and the cost of moving outputs to a caller grows with the engine's steps, not
with its tokens. This is vLLM's `RequestOutputCollector` idea (merge while the consumer lags,
never on a timer), applied per caller instead of per request.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Generic, NamedTuple, Protocol, TypeVar

from ..wire import EngineCoreOutput
from .errors import EngineError

# Request ids a caller aborted before their ADD arrived here, remembered so that the late ADD is
# refused instead of run for nobody. Aborts and ADDs are separate calls and may overtake each other.
ABORTED_IDS_REMEMBERED = 4096


class OutputSink(Protocol):
    """Where one request's outputs go, until one is finished or `fail` is called."""

    def put(self, output: EngineCoreOutput) -> None: ...

    def fail(self, request_id: str, error: EngineError) -> None: ...


class RequestStream:
    """Outputs of one request, in arrival order; an exception ends the stream."""

    __slots__ = ("queue", "finished")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[EngineCoreOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, output: EngineCoreOutput) -> None:
        self.queue.put_nowait(output)

    def fail(self, request_id: str, error: EngineError) -> None:
        self.queue.put_nowait(error)

    async def next_batch(self) -> list[EngineCoreOutput]:
        """Every output queued now (at least one), up to the finishing one; raises a queued error."""
        item = await self.queue.get()
        batch: list[EngineCoreOutput] = []
        while True:
            if isinstance(item, BaseException):
                raise item
            batch.append(item)
            if item.finished:
                self.finished = True
                return batch
            if self.queue.empty():
                return batch
            item = self.queue.get_nowait()


AnswerT = TypeVar("AnswerT")


class Taken(NamedTuple, Generic[AnswerT]):
    """What a caller takes from its channel at once."""

    outputs: list[EngineCoreOutput]
    # (request id, why it failed) of requests that ended without finishing.
    failures: list[tuple[str, str]]
    answers: list[AnswerT]


class CallerChannel(Generic[AnswerT]):
    """The outputs and failures of one caller's requests, and the answers to them, waiting for the
    caller to take them."""

    def __init__(self) -> None:
        self.outputs: list[EngineCoreOutput] = []
        # (request id, why it failed) of requests that ended without finishing.
        self.failures: list[tuple[str, str]] = []
        self.answers: list[AnswerT] = []
        # Requests of this caller the engine holds (sent and not finished).
        self.request_ids: set[str] = set()
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self._ready = asyncio.Event()
        self._woken = False

    # The engine client's sink interface (`client.OutputSink`).
    def put(self, output: EngineCoreOutput) -> None:
        self.outputs.append(output)
        if output.finished:
            self.request_ids.discard(output.request_id)
        self._ready.set()

    def fail(self, request_id: str, error: EngineError) -> None:
        self.failures.append((request_id, str(error)))
        self.request_ids.discard(request_id)
        self._ready.set()

    def answer(self, answer: AnswerT) -> None:
        """Hand the caller the answer to one of its requests (before that request's outputs, or
        after: the caller matches them by request id)."""
        self.answers.append(answer)
        self._ready.set()

    def track(self, request_id: str) -> bool:
        """Count `request_id` as this caller's; False if the caller already aborted it."""
        if request_id in self._aborted:
            del self._aborted[request_id]
            return False
        self.request_ids.add(request_id)
        return True

    def untrack(self, request_id: str) -> None:
        self.request_ids.discard(request_id)

    def aborted(self, request_ids: list[str]) -> None:
        """The caller gave these up; ids not (yet) known here are remembered (see `track`)."""
        for request_id in request_ids:
            if request_id in self.request_ids:
                self.request_ids.discard(request_id)
            else:
                self._aborted[request_id] = None
                if len(self._aborted) > ABORTED_IDS_REMEMBERED:
                    self._aborted.popitem(last=False)

    def wake(self) -> None:
        """Have the caller take what there is now, nothing included (it asked whether it is heard)."""
        self._woken = True
        self._ready.set()

    @property
    def pending(self) -> bool:
        """Whether anything waits for the caller."""
        return bool(self.outputs or self.failures or self.answers or self._woken)

    async def take(self) -> Taken[AnswerT]:
        """Everything that arrived since the last call (waits until something has, or `wake`)."""
        while not self.pending:
            self._ready.clear()
            await self._ready.wait()
        taken = Taken(self.outputs, self.failures, self.answers)
        self.outputs, self.failures, self.answers = [], [], []
        self._woken = False
        return taken

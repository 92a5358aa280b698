"""The ingress end of an engine client's output stream: each batch's outputs handed to their requests.

An ingress replica receives the outputs of all its requests on one engine client as one stream of
`OutputBatch`es (`mmserve.transit.engine_link`). `OutputDemux` hands each output to its request's
`RequestOutputs`, which merges while its consumer lags (vLLM's `RequestOutputCollector`): a slow
consumer takes everything that arrived at once, never one queue item per token. The answers to
requests come in the same batches, and go to their requests the same way. A batch lost on the way
(its number skipped: `sockets.Arrivals`), or the engine client's word that messages from here were
lost (`OutputBatch.lost`), fails every request in flight there: which of them missed a message
nobody can tell.
"""

from __future__ import annotations

import asyncio
import time

from mmserve.engine import EngineDeadError
from mmserve.wire import EngineCoreOutput

from .engine_link import AddAnswer, OutputBatch
from .refusals import LinkLost
from .sockets import Arrivals


class RequestOutputs:
    """One request's outputs not yet taken by its consumer; or the error that ended it."""

    __slots__ = ("outputs", "error", "replica", "answer", "awaiting_answer", "_ready")

    def __init__(self) -> None:
        self.outputs: list[EngineCoreOutput] = []
        self.error: BaseException | None = None
        # The engine-client replica holding the request (set once it admitted it).
        self.replica: str | None = None
        # Sent: its answer comes in a batch (`answered`), or the stream ends first.
        self.awaiting_answer = False
        self.answer: AddAnswer | None = None
        self._ready = asyncio.Event()

    def answered(self, answer: AddAnswer) -> None:
        self.answer = answer
        self._ready.set()

    async def next_answer(self) -> AddAnswer:
        """The engine client's answer to this request (waits for it); raises the error that ended
        the stream first."""
        while self.answer is None and self.error is None:
            self._ready.clear()
            await self._ready.wait()
        self.awaiting_answer = False
        if self.answer is not None:
            return self.answer
        assert self.error is not None
        raise self.error

    def put(self, output: EngineCoreOutput) -> None:
        self.outputs.append(output)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            self._ready.set()

    async def next(self) -> list[EngineCoreOutput]:
        """Every output that arrived since the last call (waits for one); then the error, if any."""
        while not self.outputs and self.error is None:
            self._ready.clear()
            await self._ready.wait()
        if self.outputs:
            outputs, self.outputs = self.outputs, []
            return outputs
        assert self.error is not None
        raise self.error


class OutputDemux:
    """The requests of one engine client, by id, as this ingress replica sent them."""

    def __init__(self) -> None:
        self._requests: dict[str, RequestOutputs] = {}
        # The engine-client replica whose stream is being read (None: none yet).
        self.replica: str | None = None
        # The batches' numbers (one stream per `subscribe` call), and when the last one came (monotonic).
        self._arrivals = Arrivals()
        self.heard_at = time.monotonic()

    def __len__(self) -> int:
        return len(self._requests)

    def register(self, request_id: str) -> RequestOutputs:
        """Before the request is sent: its outputs may arrive before its answer does."""
        outputs = self._requests[request_id] = RequestOutputs()
        return outputs

    def unregister(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def dispatch(self, batch: OutputBatch) -> None:
        self.heard_at = time.monotonic()
        if self._arrivals.lost(None, batch) or batch.lost:
            # Outputs of some of them are gone, or their requests or aborts, and the rest cannot be
            # told apart from what was lost: the requests in flight fail all (the engine client aborts
            # them when their calls are cancelled, if it has not yet), and so does this batch.
            self._fail_in_flight(LinkLost("messages between this ingress and the engine client were lost on the way"))
            return
        requests = self._requests
        for output in batch.outputs:
            if (outputs := requests.get(output.request_id)) is not None:
                outputs.put(output)
        for failure in batch.failures:
            if (outputs := requests.get(failure.request_id)) is not None:
                outputs.fail(EngineDeadError(failure.message))
        for answer in batch.answers:
            if (outputs := requests.get(answer.request_id)) is not None:
                outputs.answered(answer)

    def connected(self, replica: str) -> None:
        """A stream from `replica` began: requests admitted by any other replica will never hear
        from it again (an engine client runs one replica; a new one means the old one is gone)."""
        self.replica = replica
        for outputs in self._requests.values():
            if outputs.replica is not None and outputs.replica != replica:
                outputs.fail(LinkLost("the engine client serving this request was replaced"))

    def lost(self, error: BaseException) -> None:
        """The stream ended: every admitted request fails, and every request whose answer had not come."""
        self.replica = None
        self._fail_in_flight(error)

    def _fail_in_flight(self, error: BaseException) -> None:
        for outputs in self._requests.values():
            if outputs.replica is not None or outputs.awaiting_answer:
                outputs.fail(error)

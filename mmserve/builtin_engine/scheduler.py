"""The built-in engine's scheduler: waiting and running requests, one token per running request per step.

Stop rules follow vLLM 0.32's `check_stop`: EOS -> STOP, a `stop_token_ids` member -> STOP with
stop_reason, then max_tokens / max_model_len -> LENGTH; stop tokens are masked while fewer than
`min_tokens` tokens were produced.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from ..wire.engine_core import EngineCoreOutput, FinishReason, SchedulerStats


class Constraint(Protocol):
    """Chooses each token among those a structured-output grammar allows (`structured.GrammarFollower`)."""

    def next_token(self, own: Iterator[int], long_enough: bool) -> int: ...


@dataclass(eq=False)
class GenerationRequest:
    request_id: str
    client_index: int
    prompt_len: int
    max_tokens: int
    min_tokens: int
    eos: int | None
    stop_ids: frozenset[int]
    all_stop_ids: frozenset[int]
    natural_len: int
    stream: Iterator[int]
    num_output: int = 0
    # A structured-output grammar's choice of each token (which ends the answer itself).
    constraint: Constraint | None = None

    def next_token(self) -> int:
        n = self.num_output
        long_enough = n >= max(self.natural_len, self.min_tokens)
        if self.constraint is not None:
            return self.constraint.next_token(self.stream, long_enough)
        if self.eos is not None and long_enough:
            return self.eos
        tok = next(self.stream)
        while n < self.min_tokens and tok in self.all_stop_ids:
            tok = next(self.stream)
        return tok


@dataclass(frozen=True)
class StepBatch:
    """The requests one step computes (fixed when it starts) and the prompt tokens it prefills."""

    request_ids: tuple[str, ...]
    prefill_tokens: int

    @property
    def sequences(self) -> int:
        return len(self.request_ids)


@dataclass
class Outbox:
    """Outputs of one step (or one event), grouped by client index."""

    by_client: dict[int, list[EngineCoreOutput]] = field(default_factory=dict)

    def add(self, client_index: int, output: EngineCoreOutput) -> None:
        self.by_client.setdefault(client_index, []).append(output)


class Scheduler:
    def __init__(self, *, max_num_seqs: int, max_model_len: int, kv_capacity_tokens: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.kv_capacity_tokens = kv_capacity_tokens
        self._waiting: collections.OrderedDict[str, GenerationRequest] = collections.OrderedDict()
        self._running: dict[str, GenerationRequest] = {}

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._running or request_id in self._waiting

    def add(self, request: GenerationRequest) -> None:
        self._waiting[request.request_id] = request

    def abort(self, request_id: str) -> None:
        """Forget a request (vLLM sends nothing for client aborts)."""
        self._waiting.pop(request_id, None)
        self._running.pop(request_id, None)

    def begin_step(self) -> StepBatch:
        """Admit waiting requests up to max_num_seqs: the batch of the step that starts now."""
        prefill_tokens = 0
        while self._waiting and len(self._running) < self.max_num_seqs:
            rid, req = self._waiting.popitem(last=False)
            self._running[rid] = req
            prefill_tokens += req.prompt_len
        return StepBatch(tuple(self._running), prefill_tokens)

    def finish_step(self, batch: StepBatch) -> Outbox:
        """One token for every request of the batch that is still running (not aborted meanwhile)."""
        outbox = Outbox()
        for rid in batch.request_ids:
            req = self._running.get(rid)
            if req is None:
                continue
            tok = req.next_token()
            req.num_output += 1
            finish: FinishReason | None = None
            stop_reason: int | None = None
            if req.eos is not None and tok == req.eos:
                finish = FinishReason.STOP
            elif tok in req.stop_ids:
                finish, stop_reason = FinishReason.STOP, tok
            elif req.prompt_len + req.num_output >= self.max_model_len or req.num_output >= req.max_tokens:
                finish = FinishReason.LENGTH
            outbox.add(req.client_index, EngineCoreOutput(rid, [tok], finish_reason=finish, stop_reason=stop_reason))
            if finish is not None:
                del self._running[rid]
        return outbox

    def abort_all(self) -> Outbox:
        """ABORT outputs for every request (shutdown), which are then forgotten."""
        outbox = Outbox()
        for req in [*self._running.values(), *self._waiting.values()]:
            outbox.add(req.client_index, EngineCoreOutput(req.request_id, [], finish_reason=FinishReason.ABORT))
        self._running.clear()
        self._waiting.clear()
        return outbox

    def stats(self) -> SchedulerStats:
        used = sum(r.prompt_len + r.num_output for r in self._running.values())
        return SchedulerStats(
            num_running_reqs=len(self._running),
            num_waiting_reqs=len(self._waiting),
            kv_cache_usage=min(1.0, used / self.kv_capacity_tokens),
        )

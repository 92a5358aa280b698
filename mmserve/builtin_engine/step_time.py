"""How long the built-in engine's steps take: a GPU engine's, modelled.

A vLLM engine step is one forward pass over its batch: the prompt tokens it prefills and one token for each
sequence it decodes. On a GPU a step's time is a fixed part (reading the weights, launching the kernels),
nearly flat in the batch at the sizes a front end sees, plus what grows with the work: a cost per decoding
sequence (its attention over its context, its sampling) and a cost per prefilled prompt token (an image's
tokens among them: its encoder's work is counted as its tokens). The built-in engine waits that long after
a step starts before it sends the step's tokens, and starts the next step then: requests that arrive
meanwhile join the next step, as in vLLM's scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepTime:
    """A step's modelled duration: `base_ms` + `us_per_sequence` × sequences + `us_per_prefill_token` × prompt tokens."""

    base_ms: float
    us_per_sequence: float = 0.0
    us_per_prefill_token: float = 0.0

    def __post_init__(self) -> None:
        if min(self.base_ms, self.us_per_sequence, self.us_per_prefill_token) < 0:
            raise ValueError(f"step times must not be negative: {self}")

    def seconds(self, sequences: int, prefill_tokens: int) -> float:
        return self.base_ms / 1e3 + (self.us_per_sequence * sequences + self.us_per_prefill_token * prefill_tokens) / 1e6

"""Stop conditions, split the way vLLM splits them.

* Stop *token ids* (EOS and ``stop_token_ids``) are checked by the engine
  (scheduler ``check_stop``): the gateway only computes which ids to send
  (``resolve_stop_token_ids``, = ``SamplingParams.update_from_generation_config``)
  and gets ``finish_reason``/``stop_reason`` back. ``stop_token_reason`` mirrors
  the engine's convention for engines we implement ourselves.
* Stop *strings* are checked in the frontend, on the detokenized text
  (``SequenceText``, = vLLM's ``BaseIncrementalDetokenizer.update`` and
  ``get_next_output_text``, with ``check_stop_strings`` verbatim).
"""

from __future__ import annotations

import sys
from bisect import bisect_left
from dataclasses import dataclass

from .detokenizer import IncrementalDetokenizer


@dataclass(frozen=True, slots=True)
class StopTokenIds:
    """What the engine request carries (vLLM SamplingParams fields)."""

    eos_token_id: int | None  # ``_eos_token_id``: stops with stop_reason None
    stop_token_ids: list[int]  # stops with stop_reason = the token id
    all_stop_token_ids: frozenset[int]  # masked by min_tokens in the sampler


def resolve_stop_token_ids(
    *,
    tokenizer_eos_token_id: int | None,
    generation_eos_token_ids: tuple[int, ...],
    request_stop_token_ids: list[int] | None,
    ignore_eos: bool = False,
) -> StopTokenIds:
    """``SamplingParams.update_from_generation_config`` (run by vLLM's input
    processor): the tokenizer's EOS is the primary EOS; generation_config EOS
    ids that differ from it are appended to ``stop_token_ids`` (so they are
    reported as ``stop_reason=<id>``). With ``ignore_eos`` none of them stop the
    sequence but they are still suppressed before ``min_tokens``.
    """
    stop_token_ids = list(request_stop_token_ids or [])
    all_stop = set(stop_token_ids)
    eos_token_id = None if ignore_eos else tokenizer_eos_token_id
    if tokenizer_eos_token_id is not None:
        all_stop.add(tokenizer_eos_token_id)
    eos_ids = set(generation_eos_token_ids)
    eos_ids.discard(tokenizer_eos_token_id)  # type: ignore[arg-type]
    if eos_ids:
        all_stop.update(eos_ids)
        if not ignore_eos:
            # vLLM builds the list from a set: same operations => same order.
            eos_ids.update(stop_token_ids)
            stop_token_ids = list(eos_ids)
    return StopTokenIds(eos_token_id, stop_token_ids, frozenset(all_stop))


def stop_token_reason(token_id: int, stop: StopTokenIds) -> tuple[bool, int | None]:
    """Scheduler ``check_stop`` for the last sampled token: (stopped, stop_reason).
    EOS -> (True, None); a stop token id -> (True, id). min_tokens never reaches
    here: the sampler masks all stop ids until min_tokens are generated."""
    if token_id == stop.eos_token_id:
        return True, None
    if token_id in stop.stop_token_ids:
        return True, token_id
    return False, None


def check_stop_strings(
    output_text: str,
    new_char_count: int,
    stop: list[str],
    include_in_output: bool,
) -> tuple[str, int] | None:
    """vLLM's ``check_stop_strings``, verbatim semantics.

    Returns (stop_string, truncate_to) or None; ``truncate_to`` is -1 for "no
    truncation". Only stop strings ending inside the last ``new_char_count``
    chars are searched; the one completing earliest wins, ties by list order.
    """
    if not new_char_count or not stop:
        return None

    best_stop_str: str | None = None
    best_stop_index = 0
    best_end = sys.maxsize
    for stop_str in stop:
        stop_string_len = len(stop_str)
        # Negative start = offset from the end: skip already-searched text.
        stop_index = output_text.find(stop_str, 1 - new_char_count - stop_string_len)
        if stop_index == -1:
            continue
        end = stop_index + stop_string_len
        if end < best_end:
            best_stop_str = stop_str
            best_stop_index = stop_index
            best_end = end

    if best_stop_str is None:
        return None
    if include_in_output:
        if best_end >= len(output_text):
            return best_stop_str, -1
        return best_stop_str, best_end
    return best_stop_str, best_stop_index


class SequenceText:
    """Output text of one sequence: detokenization + stop strings + the
    streaming hold-back, as vLLM's ``BaseIncrementalDetokenizer``.

    Per engine step::

        stop_str = seq.update(new_ids, stop_terminated=(finish_reason == STOP))
        if stop_str: finish_reason, stop_reason = STOP, stop_str  # and abort the engine request
        delta = seq.next_delta(finished)

    ``token_ids`` are the output ids kept (ids after a stop string are dropped).
    """

    def __init__(
        self,
        detokenizer: IncrementalDetokenizer,
        *,
        stop: list[str] | str | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._detok = detokenizer
        self.stop: list[str] = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        # Chars held back while streaming so that a stop string split across
        # steps is never emitted: one less than the longest stop string.
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1 if self.stop and not include_stop_str_in_output else 0
        )
        self.token_ids: list[int] = []
        self.output_text = ""
        self._last_output_text_offset = 0

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Detokenize new ids and check stop strings; returns the matched stop string."""
        if not new_token_ids:
            return None

        # The engine stopped on EOS / a stop token id: that token's text is
        # excluded unless include_stop_str_in_output (it is still counted).
        skipped_stop_token_id = None
        if stop_terminated and not self.include_stop_str_in_output:
            skipped_stop_token_id = new_token_ids[-1]
            new_token_ids = new_token_ids[:-1]

        num_prev_tokens = len(self.token_ids)
        # Output text offsets at the boundaries of the new tokens.
        token_offsets = [len(self.output_text)] if self.stop else None
        pieces: list[str] = []
        text_len = len(self.output_text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            piece = self._detok.decode_next(token_id)
            pieces.append(piece)
            text_len += len(piece)
            if token_offsets is not None:
                token_offsets.append(text_len)
        self.output_text += "".join(pieces)

        if skipped_stop_token_id is not None:
            self.token_ids.append(skipped_stop_token_id)
            if token_offsets is not None:
                token_offsets.append(len(self.output_text))

        # Stop strings only count once more than min_tokens tokens exist, and
        # only text produced after the min_tokens-th token is searched.
        if token_offsets is None or len(self.token_ids) <= self.min_tokens:
            return None
        stop_check_offset = token_offsets[max(self.min_tokens - num_prev_tokens, 0)]
        match = check_stop_strings(
            output_text=self.output_text,
            new_char_count=len(self.output_text) - stop_check_offset,
            stop=self.stop,
            include_in_output=self.include_stop_str_in_output,
        )
        if match is None:
            return None
        stop_string, truncate_to = match
        stop_end = len(self.output_text) if truncate_to == -1 else truncate_to
        if not self.include_stop_str_in_output:
            stop_end += len(stop_string)
        # Drop tokens generated after the one completing the stop string
        # (several tokens can arrive in one step, e.g. speculative decoding).
        num_kept = bisect_left(token_offsets, stop_end, lo=1)
        del self.token_ids[num_prev_tokens + num_kept :]
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop_string

    def next_delta(self, finished: bool) -> str:
        """New text since the previous call; holds back ``stop_buffer_length``
        chars until ``finished`` (vLLM ``get_next_output_text(delta=True)``)."""
        length = len(self.output_text) - (0 if finished else self.stop_buffer_length)
        last = self._last_output_text_offset
        if last < length:
            self._last_output_text_offset = length
            return self.output_text[last:length]
        return ""

    def text(self, finished: bool) -> str:
        """Cumulative text (vLLM ``get_next_output_text(delta=False)``)."""
        buffer_length = 0 if finished else self.stop_buffer_length
        return self.output_text[:-buffer_length] if buffer_length else self.output_text

"""A stream's token ids → terminals before any text is lexed: vLLM 0.32's `TokenIDScanner`
(`vllm/parser/engine/token_id_scanner.py`).

A token that is a terminal of the grammar (`</think>` as one token) or a special token the parser drops
is recognised by its id, not its text, so that the same text written by ordinary tokens stays text. The
delta's text is then split around those terminals. The detokenizer may hold text back (an incomplete
character) and send it with a later delta: a terminal whose text has not come yet waits for it, and text
a delta carries without ids of its own (text held back earlier) goes first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

DROP = "__DROP__"  # vLLM's DROP_TERMINAL: a special token the grammar does not name


@dataclass(slots=True)
class TextChunk:
    text: str
    token_texts: tuple[str, ...] = ()
    token_count: int = 0


@dataclass(slots=True)
class PreLexedTerminal:
    terminal: str
    token_id: int
    text: str


LexerInput = TextChunk | PreLexedTerminal


class TokenIDScanner:
    """vLLM's `TokenIDScanner`."""

    def __init__(self, terminal_of_id: dict[int, str], decode_token: Callable[[int], str]) -> None:
        """`decode_token`: one token's text, as `tokenizer.decode([id])` gives it (special tokens kept)."""
        self.terminal_of_id = terminal_of_id
        self._decode_one = decode_token
        self._texts: dict[int, str] = {}
        self.deferred: list[PreLexedTerminal] = []
        self._deferred_prefix_counts: list[int] = []
        self._deferred_trailing_count = 0
        self._deferred_post_text = ""

    def reset(self) -> None:
        self.deferred.clear()
        self._deferred_prefix_counts.clear()
        self._deferred_trailing_count = 0
        self._deferred_post_text = ""

    def _decode(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode_one(token_id)
        return text

    def scan(self, delta_text: str, delta_token_ids: Sequence[int]) -> list[LexerInput]:
        prefix: list[LexerInput] = []
        text, trailing = delta_text, 0
        if self.deferred:
            prefix, text, trailing = self._resolve_deferred(delta_text, len(delta_token_ids))
        if not any(token_id in self.terminal_of_id for token_id in delta_token_ids):
            if text:
                texts = tuple(self._decode(token_id) for token_id in delta_token_ids)
                prefix.append(TextChunk(text, texts, (trailing if prefix else 0) + len(texts)))
            return prefix

        results: list[LexerInput] = []
        pending: list[str] = []  # decoded texts of the ordinary tokens since the last terminal
        for token_id in delta_token_ids:
            terminal = self.terminal_of_id.get(token_id)
            if terminal is None:
                pending.append(self._decode(token_id))
                continue
            if "".join(pending):
                results.append(TextChunk("".join(pending), tuple(pending), len(pending)))
            pending = []
            results.append(PreLexedTerminal(terminal, token_id, self._decode(token_id)))
        if "".join(pending):
            results.append(TextChunk("".join(pending), tuple(pending), len(pending)))
        if trailing:
            results.insert(0, TextChunk("", token_count=trailing))

        if text:
            results = self._recover_holdback_text(text, results)
        else:
            # No text to split: the tokens' own texts are unreliable in isolation (context-dependent
            # decoding), so the terminals wait for the text that comes with a later delta.
            count = 0
            for item in results:
                if isinstance(item, TextChunk):
                    count += item.token_count
                else:
                    self.deferred.append(item)
                    self._deferred_prefix_counts.append(count)
                    count = 0
            self._deferred_trailing_count += count
            results = []
        return prefix + results

    def flush_pending(self) -> list[LexerInput]:
        if not self.deferred and not self._deferred_post_text:
            return []
        results: list[LexerInput] = []
        if self._deferred_post_text:
            count = self._deferred_prefix_counts[0] if self._deferred_prefix_counts else 0
            results.append(TextChunk(self._deferred_post_text, token_count=count))
            self._deferred_post_text = ""
        results.extend(self.deferred)
        if self._deferred_trailing_count:
            results.append(TextChunk("", token_count=self._deferred_trailing_count))
        self.deferred.clear()
        self._deferred_prefix_counts.clear()
        self._deferred_trailing_count = 0
        return results

    def _resolve_deferred(self, delta_text: str, delta_token_count: int) -> tuple[list[LexerInput], str, int]:
        """Split `delta_text` at the waiting terminals' texts: what comes before belongs to the state
        before each; returns (items, the rest of the text, tokens still owed to the rest)."""
        deferred, prefix_counts, trailing = self.deferred, self._deferred_prefix_counts, self._deferred_trailing_count
        self.deferred, self._deferred_prefix_counts, self._deferred_trailing_count = [], [], 0
        results: list[LexerInput] = []
        remaining = self._deferred_post_text + delta_text
        self._deferred_post_text = ""
        for terminal, count in zip(deferred, prefix_counts):
            pos = remaining.find(terminal.text)
            if pos >= 0:
                if pos > 0:
                    results.append(TextChunk(remaining[:pos], token_count=count))
                results.append(terminal)
                remaining = remaining[pos + len(terminal.text) :]
                continue
            # Not here yet: keep the text until the terminal's own text comes (the only reliable cut).
            if remaining:
                self._deferred_post_text += remaining
                count += delta_token_count
                remaining = ""
            self.deferred.append(terminal)
            self._deferred_prefix_counts.append(count)
        if self.deferred:
            self._deferred_trailing_count, trailing = trailing, 0
        return results, remaining, trailing

    def _recover_holdback_text(self, delta_text: str, results: list[LexerInput]) -> list[LexerInput]:
        """Text the detokenizer held back earlier comes first in `delta_text`, with no ids of its own."""
        if not results:
            return [TextChunk(delta_text)]
        rebuilt = "".join(item.text for item in results)
        if not rebuilt:
            return [TextChunk(delta_text), *results]
        pos = delta_text.find(rebuilt)
        if pos > 0:
            return [TextChunk(delta_text[:pos]), *results]
        if pos == 0:
            return results
        return self._rebuild_from_anchors(delta_text, results)

    def _rebuild_from_anchors(self, delta_text: str, results: list[LexerInput]) -> list[LexerInput]:
        """The tokens' texts do not add up to `delta_text` (context-dependent decoding): cut it at the
        terminals' texts instead, each bound to its rightmost place before the next; a terminal whose text
        is not there waits for a later delta."""
        anchors = [item for item in results if isinstance(item, PreLexedTerminal)]
        if not anchors:
            return [TextChunk(delta_text)]
        token_groups: list[list[str]] = [[] for _ in range(len(anchors) + 1)]
        count_groups = [0] * (len(anchors) + 1)
        group = 0
        for item in results:
            if isinstance(item, PreLexedTerminal):
                group += 1
            else:
                token_groups[group].extend(item.token_texts)
                count_groups[group] += item.token_count
        positions = [-1] * len(anchors)
        search_end = len(delta_text)
        for i in range(len(anchors) - 1, -1, -1):
            pos = delta_text.rfind(anchors[i].text, 0, search_end)
            if pos >= 0:
                positions[i] = search_end = pos
        rebuilt: list[LexerInput] = []
        consumed = 0
        for i, anchor in enumerate(anchors):
            pos = positions[i]
            if pos >= consumed:
                if pos > consumed:
                    rebuilt.append(TextChunk(delta_text[consumed:pos], tuple(token_groups[i]), count_groups[i]))
                rebuilt.append(anchor)
                consumed = pos + len(anchor.text)
                continue
            # A dropped special token's text may never come (the detokenizer skipped it): do not hold
            # the rest of the text for it.
            if not any(p >= 0 for p in positions[i + 1 :]) and consumed < len(delta_text) and anchor.terminal != DROP:
                self._deferred_post_text += delta_text[consumed:]
                consumed = len(delta_text)
            self.deferred.append(anchor)
            self._deferred_prefix_counts.append(count_groups[i])
        if consumed < len(delta_text):
            rebuilt.append(TextChunk(delta_text[consumed:], tuple(token_groups[-1]), count_groups[-1]))
        return rebuilt

"""Text → terminals, holding back what may still become one: vLLM 0.32's `IncrementalLexer`
(`vllm/parser/engine/incremental_lexer.py`) for a grammar of literal terminals only (every parser
engine config vLLM ships is literals).

A stream's text arrives cut anywhere: `"<tool_"` may be the start of `"<tool_call>"`, so it stays in
the buffer until the next text settles it, and only `flush` at the end gives it up as content. Each
character also carries the number of tokens that started on it, so that the parser can count the
tokens of what it classifies (usage's reasoning tokens) exactly as vLLM counts them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

CONTENT = "__CONTENT__"  # vLLM's CONTENT_TERMINAL: text that is no terminal


@dataclass(slots=True)
class LexToken:
    """vLLM's `LexToken`: a terminal (or CONTENT) with its text and the tokens that started in it."""

    terminal: str
    value: str
    token_count: int = 0


class LexerShape:
    """vLLM's `LexerShape`: what the literals imply, computed once per grammar and shared."""

    __slots__ = ("literals", "first_chars", "prefixes", "literals_by_first")

    def __init__(self, literals: Iterable[tuple[str, str]]) -> None:
        """`literals`: (terminal name, text) pairs; a name may have several texts."""
        # (vLLM sorts them longest pattern first; no answer here depends on their order: the longest
        # match wins, and a content boundary is the first position any literal may start at.)
        self.literals = [(text, name) for name, text in literals]
        self.first_chars = frozenset(text[0] for text, _ in self.literals if text)
        self.prefixes = frozenset(text[:i] for text, _ in self.literals for i in range(1, len(text)))
        by_first: dict[str, list[tuple[str, str]]] = {}
        for text, name in self.literals:
            if text:
                by_first.setdefault(text[0], []).append((text, name))
        self.literals_by_first = by_first


class IncrementalLexer:
    """vLLM's `IncrementalLexer`, literal terminals only."""

    def __init__(self, shape: LexerShape) -> None:
        self.shape = shape
        self.buffer = ""
        self._token_counts: list[int] = []  # per character of the buffer

    def reset(self) -> None:
        self.buffer = ""
        self._token_counts.clear()

    def feed(self, text: str, token_texts: tuple[str, ...] = (), token_count: int = 0) -> list[LexToken]:
        counts = _char_token_counts(text, token_texts, token_count)
        if not self.buffer and self.shape.first_chars and self.shape.first_chars.isdisjoint(text):
            return [LexToken(CONTENT, text, sum(counts))]
        self.buffer += text
        self._token_counts.extend(counts)
        return self._drain(final=False)

    def flush(self) -> list[LexToken]:
        tokens = self._drain(final=True) if self.buffer else []
        if self.buffer:
            tokens.append(LexToken(CONTENT, self.buffer, sum(self._token_counts)))
            self.reset()
        return tokens

    def _pop(self, terminal: str, length: int) -> LexToken:
        token = LexToken(terminal, self.buffer[:length], sum(self._token_counts[:length]))
        self.buffer = self.buffer[length:]
        del self._token_counts[:length]
        return token

    def _drain(self, *, final: bool) -> list[LexToken]:
        tokens: list[LexToken] = []
        shape = self.shape
        while self.buffer:
            if shape.first_chars and shape.first_chars.isdisjoint(self.buffer):
                tokens.append(self._pop(CONTENT, len(self.buffer)))
                break
            candidates = shape.literals_by_first.get(self.buffer[0], ())
            best: tuple[str, int] | None = None  # (terminal, length): the longest literal the buffer starts with
            for text, name in candidates:
                if self.buffer.startswith(text) and (best is None or len(text) > best[1]):
                    best = (name, len(text))
            # The whole buffer may still grow into a (longer) literal: wait for more text, unless the
            # match it already is cannot get longer.
            if self.buffer in shape.prefixes and not final:
                if best is None or any(len(text) > best[1] and text.startswith(self.buffer) for text, _ in candidates):
                    break
                tokens.append(self._pop(*best))
                continue
            if best is not None:
                tokens.append(self._pop(*best))
            else:
                tokens.append(self._pop(CONTENT, max(self._content_end(), 1)))
        return tokens

    def _content_end(self) -> int:
        """Where content ends: the first later position from which a literal may start."""
        buf, n = self.buffer, len(self.buffer)
        first_chars = self.shape.first_chars
        for i in range(1, n):
            if buf[i] not in first_chars:
                continue
            for text, _ in self.shape.literals:
                length = min(n - i, len(text))
                if buf[i : i + length] == text[:length]:
                    return i
        return n


def _char_token_counts(text: str, token_texts: tuple[str, ...], token_count: int) -> list[int]:
    """The tokens that start on each character: each token's text found in order (vLLM's
    `_char_token_counts`); tokens not found are put on the first character."""
    counts = [0] * len(text)
    if not text:
        return counts
    if token_texts:
        pos = assigned = 0
        for token_text in token_texts:
            if not token_text:
                continue
            found = text.find(token_text, pos)
            if found < 0:
                continue
            counts[found] += 1
            assigned += 1
            pos = found + len(token_text)
        if token_count > assigned:
            counts[0] += token_count - assigned
    elif token_count:
        counts[0] = token_count
    return counts

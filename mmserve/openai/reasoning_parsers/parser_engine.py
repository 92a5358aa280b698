"""vLLM 0.32's declarative parser engine (`vllm/parser/engine/`), as its reasoning adapter runs it.

vLLM's newer reasoning parsers (`qwen3` among them) are a grammar (`ParserEngineConfig`: literal
terminals, terminals recognised by token id, a state machine) driven by one engine that reads reasoning
and tool calls alike. Served as `--reasoning-parser`, vLLM wraps it in `ParserEngineReasoningAdapter`,
which runs it with `skip_tool_parsing` on: tool-call markup is then text of the state it is in (a tool
call's start still ends the reasoning where the grammar says so). Only that use is ported here, so the
engine only ever is in the REASONING or CONTENT state, and its events are reasoning text, content text
and the end of the reasoning:

- the grammar (`ParserEngineConfig`) is in `grammar.py`;
- `ReasoningEngine` mirrors `StreamingParserEngine` (token-id scan, incremental lexing, transitions, and
  the count of reasoning tokens);
- `EngineReasoningParser` mirrors `ParserEngine` behind `ParserEngineReasoningAdapter`: whole answers,
  streamed deltas, `is_reasoning_end` on the prompt, the reasoning tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..message_delta import MessageDelta
from .base import ReasoningParser
from .grammar import TOOL_STATES, Event, GrammarForTokenizer, State, Transition
from .lexer import CONTENT, IncrementalLexer, LexToken
from .token_id_scanner import DROP, LexerInput, PreLexedTerminal, TextChunk, TokenIDScanner


@dataclass(slots=True)
class SemanticEvent:
    type: Event
    value: str = ""
    token_count: int = 0


class ReasoningEngine:
    """vLLM's `StreamingParserEngine` with `skip_tool_parsing` on: (text, token ids) → events."""

    def __init__(self, bound: GrammarForTokenizer) -> None:
        self.bound = bound
        self.grammar = bound.grammar
        self._scanner = TokenIDScanner(bound.terminal_of_id, bound.decode_token)
        self._lexer = IncrementalLexer(bound.lexer_shape)
        self._id_terminal_names = frozenset(bound.terminal_of_id.values())
        self._tool_terminals = bound.tool_terminals
        self._tool_exit_terminals = bound.tool_exit_terminals
        self.reset()

    def reset(self) -> None:
        self.state = self.grammar.initial_state
        self._ever_had_token_ids = False
        self.reasoning_token_count = 0
        self._in_skipped_tool_span = False
        self._scanner.reset()
        self._lexer.reset()

    def feed(self, delta_text: str, delta_token_ids: Sequence[int]) -> list[SemanticEvent]:
        if delta_token_ids:
            self._ever_had_token_ids = True
        if (
            delta_text
            and not self._lexer.buffer
            and not self._scanner.deferred
            and self._lexer.shape.first_chars.isdisjoint(delta_text)
            and not any(token_id in self.bound.terminal_of_id for token_id in delta_token_ids)
        ):
            events = self._emit_for_state(delta_text, len(delta_token_ids))  # plain text: no lexing needed
        else:
            items = self._scanner.scan(delta_text, delta_token_ids)
            if len(items) == 1 and isinstance(items[0], TextChunk):
                tokens = self._lexer.feed(items[0].text, items[0].token_texts, items[0].token_count)
                if len(tokens) == 1 and tokens[0].terminal == CONTENT:
                    events = self._emit_for_state(tokens[0].value, tokens[0].token_count)
                else:
                    events = self._on_lex_tokens(tokens)
            else:
                events = self._on_items(items)
        self._count_reasoning(events)
        return events

    def finish(self) -> list[SemanticEvent]:
        events = self._on_items(self._scanner.flush_pending())
        events += self._on_lex_tokens(self._lexer.flush())
        if self.state is State.REASONING:
            events.append(SemanticEvent(Event.REASONING_END))
            self.state = State.CONTENT
        self._count_reasoning(events)
        return events

    def _count_reasoning(self, events: list[SemanticEvent]) -> None:
        self.reasoning_token_count += sum(e.token_count for e in events if e.type is Event.REASONING_CHUNK)

    def _on_items(self, items: Sequence[LexerInput]) -> list[SemanticEvent]:
        events: list[SemanticEvent] = []
        for item in items:
            if isinstance(item, PreLexedTerminal):
                events += self._on_lex_tokens(self._lexer.flush())
                events += self._on_terminal(item.terminal, item.text)
            elif not item.text and item.token_count:
                events += self._emit_for_state("", item.token_count)
            else:
                events += self._on_lex_tokens(self._lexer.feed(item.text, item.token_texts, item.token_count))
        return events

    def _on_lex_tokens(self, tokens: list[LexToken]) -> list[SemanticEvent]:
        # Once a stream has given token ids, a terminal that has an id is one only by its id: the same
        # text written by ordinary tokens is text.
        by_id_only = self._id_terminal_names if self._ever_had_token_ids else frozenset()
        events: list[SemanticEvent] = []
        for token in tokens:
            if token.terminal == CONTENT or token.terminal in by_id_only:
                if token.value:
                    events += self._emit_for_state(token.value, token.token_count)
            else:
                events += self._on_terminal(token.terminal, token.value, token.token_count)
        return events

    def _on_terminal(self, terminal: str, value: str, token_count: int = 0) -> list[SemanticEvent]:
        transition = self.grammar.transitions.get((self.state, terminal))
        if transition is None:
            if self.bound.has_drops and terminal == DROP:
                return []
            if terminal in self._tool_exit_terminals:
                self._in_skipped_tool_span = False
            return self._emit_for_state(value, token_count)
        if terminal in self._tool_terminals:
            opens = transition.next_state in TOOL_STATES
            exits = terminal in self._tool_exit_terminals
            if not (exits and not opens and not self._in_skipped_tool_span):
                # Tool markup is text here, but a tool call's start still ends the reasoning.
                if opens:
                    self._in_skipped_tool_span = True
                elif exits:
                    self._in_skipped_tool_span = False
                if Event.REASONING_END in transition.events:
                    self.state = State.CONTENT
                    return [SemanticEvent(Event.REASONING_END, value), SemanticEvent(Event.TEXT_CHUNK, value)]
                return self._emit_for_state(value, 0)
        return self._apply(transition, value, token_count)

    def _apply(self, transition: Transition, value: str, token_count: int) -> list[SemanticEvent]:
        if transition.next_state in TOOL_STATES:
            raise AssertionError(f"{self.grammar.name}: a tool state is reached with tool parsing skipped")
        self.state = transition.next_state
        return [
            SemanticEvent(event, value, token_count)
            for event in transition.events
            if not (event is Event.TEXT_CHUNK and not value)
        ]

    def _emit_for_state(self, text: str, token_count: int) -> list[SemanticEvent]:
        kind = Event.REASONING_CHUNK if self.state is State.REASONING else Event.TEXT_CHUNK
        return [SemanticEvent(kind, text, token_count)]


class EngineReasoningParser(ReasoningParser):
    """vLLM's `ParserEngine` behind its `ParserEngineReasoningAdapter`: one per choice of a request."""

    # vLLM's `engine_based_streaming`: the stream's reasoning ends when the engine says so, what it still
    # holds is flushed then, and the parser keeps its own state (only each delta is passed in).
    engine_based = True

    def __init__(self, bound: GrammarForTokenizer) -> None:
        self.bound = bound
        self.grammar = bound.grammar
        self._engine = ReasoningEngine(bound)
        self._has_reasoning = (
            "THINK_END" in self.grammar.token_id_terminals
            or "THINK_START" in self.grammar.terminals
            or "THINK_END" in self.grammar.terminals
            or self.grammar.initial_state is State.REASONING
        )
        self._streaming_initialized = False
        self._streaming_count_valid = False
        self._reset()

    def _reset(self) -> None:
        self._engine.reset()
        self._reasoning_ended = not self._has_reasoning

    # ------------------------------------------------------------------ the prompt

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether the prompt leaves the reasoning ended: the last reasoning tag of its last turn decides,
        else the grammar (a thinking grammar waits for the reasoning to end)."""
        start = self.grammar.transitions.get((self.grammar.initial_state, "THINK_START"))
        start_opens_reasoning = start is not None and start.next_state is State.REASONING
        bound = self.bound
        for token_id in reversed(input_ids):
            if token_id in bound.reasoning_end_token_ids:
                return True
            if token_id == bound.start_token_id:
                if start_opens_reasoning:
                    return False
                break
            if token_id in bound.turn_boundary_ids:
                break
        return not self.grammar.waits_for_reasoning

    # ------------------------------------------------------------------ whole answers

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        self._streaming_count_valid = False
        self._reset()
        events = self._engine.feed(model_output, []) + self._engine.finish()
        reasoning = "".join(e.value for e in events if e.type is Event.REASONING_CHUNK)
        content = "".join(e.value for e in events if e.type is Event.TEXT_CHUNK)
        return reasoning or None, content or None

    # ------------------------------------------------------------------ streams

    def extract_reasoning_streaming(
        self, delta_text: str, previous_token_ids: Sequence[int], delta_token_ids: Sequence[int]
    ) -> MessageDelta | None:
        """The delta's reasoning and content (`previous_token_ids` is not read: the engine keeps its state)."""
        self._streaming_count_valid = True
        if not self._streaming_initialized:
            self._streaming_initialized = True
            self._reset()
        return self._events_to_delta(self._engine.feed(delta_text, delta_token_ids))

    def has_engine_confirmed_reasoning_end(self) -> bool:
        return self._reasoning_ended

    def finish_streaming(self) -> MessageDelta | None:
        """What the engine still holds (a partial terminal, text waiting for a terminal's own text)."""
        events = self._engine.finish()
        return self._events_to_delta(events) if events else None

    def _events_to_delta(self, events: list[SemanticEvent]) -> MessageDelta | None:
        """The events' reasoning and content. (vLLM's also holds back content that is only whitespace
        until more comes; content only ever comes in the delta that ends the reasoning, which the adapter
        flushes at once, so that holding back changes no delta here and is left out.)"""
        content_parts: list[str] = []
        reasoning_parts: list[str] = []
        for event in events:
            if event.type is Event.TEXT_CHUNK:
                content_parts.append(event.value)
            elif event.type is Event.REASONING_CHUNK:
                reasoning_parts.append(event.value)
            elif event.type is Event.REASONING_END:
                self._reasoning_ended = True
        content, reasoning = "".join(content_parts), "".join(reasoning_parts)
        if not content and not reasoning:
            return None
        delta = MessageDelta()
        if content:
            delta.content = content
        if reasoning:
            delta.reasoning = reasoning
        return delta

    # ------------------------------------------------------------------ usage

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """A stream's count is what its engine classified as reasoning; a whole answer (or a stream never
        read for reasoning) is parsed again from its token ids. (vLLM parses it with tool parsing on:
        the count is the same, as no transition leads back into the reasoning.)"""
        if self._streaming_count_valid:
            return self._engine.reasoning_token_count
        if not token_ids:
            return 0
        engine = ReasoningEngine(self.bound)
        engine.feed(self.bound.decode(list(token_ids)), token_ids)
        engine.finish()
        return engine.reasoning_token_count

"""vLLM 0.32's parser grammars (`ParserEngineConfig`, `vllm/parser/engine/parser_engine_config.py`), and a
grammar bound to a model's tokenizer: what the parser engine (`parser_engine.py`) runs.

The tool states are kept in a grammar's transitions although the reasoning parser never enters them:
what ends the reasoning and which terminals are tool markup are read from them, as vLLM reads them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from mmserve.text import Tokenizer

from .lexer import LexerShape
from .token_id_scanner import DROP


class State(enum.Enum):
    """vLLM's `ParserState` (its MESSAGE_HEADER state is used by no grammar served here)."""

    CONTENT = enum.auto()
    REASONING = enum.auto()
    TOOL_PREAMBLE = enum.auto()
    TOOL_NAME = enum.auto()
    TOOL_ARGS = enum.auto()
    TOOL_BETWEEN = enum.auto()


TOOL_STATES = frozenset({State.TOOL_PREAMBLE, State.TOOL_NAME, State.TOOL_ARGS, State.TOOL_BETWEEN})


class Event(enum.Enum):
    """vLLM's `EventType`."""

    TEXT_CHUNK = enum.auto()
    REASONING_START = enum.auto()
    REASONING_CHUNK = enum.auto()
    REASONING_END = enum.auto()
    TOOL_CALL_START = enum.auto()
    TOOL_NAME = enum.auto()
    ARG_VALUE_CHUNK = enum.auto()
    TOOL_CALL_END = enum.auto()


@dataclass(frozen=True, slots=True)
class Transition:
    """vLLM's `Transition` (none served here is skipped in token-id mode)."""

    next_state: State
    events: tuple[Event, ...] = ()


@dataclass(frozen=True)
class ParserGrammar:
    """vLLM's `ParserEngineConfig`, the fields its reasoning adapter reads for grammars like Qwen3's (one
    that strips trailing reasoning whitespace, `strip_trailing_reasoning_whitespace`, is not served)."""

    name: str
    terminals: dict[str, str]
    token_id_terminals: dict[str, str]
    transitions: dict[tuple[State, str], Transition]
    initial_state: State
    wait_for_reasoning: bool | None
    turn_boundary_tokens: frozenset[str] = field(default_factory=frozenset)

    @property
    def waits_for_reasoning(self) -> bool:
        if self.wait_for_reasoning is None:
            return self.initial_state is State.REASONING
        return self.wait_for_reasoning

    def tool_terminals(self) -> frozenset[str]:
        """Terminals of tool-call markup: any transition into, or within, a tool state."""
        return frozenset(
            terminal for (state, terminal), tr in self.transitions.items() if tr.next_state in TOOL_STATES or state in TOOL_STATES
        )

    def tool_exit_terminals(self) -> frozenset[str]:
        return frozenset(
            terminal
            for (state, terminal), tr in self.transitions.items()
            if state in TOOL_STATES and tr.next_state not in TOOL_STATES
        )


@dataclass(frozen=True)
class GrammarForTokenizer:
    """A grammar bound to a model's tokenizer, built once per model and shared by its parsers: the ids of
    its terminals, the special tokens it drops (by id, and by text where no ids are given), the lexer."""

    grammar: ParserGrammar
    terminal_of_id: dict[int, str]
    has_drops: bool
    lexer_shape: LexerShape
    start_token_id: int | None
    end_token_id: int | None
    reasoning_end_token_ids: frozenset[int]
    turn_boundary_ids: frozenset[int]
    # Read from the transitions once per model, not per parser (one per choice of every request).
    tool_terminals: frozenset[str]
    tool_exit_terminals: frozenset[str]
    decode_token: Callable[[int], str]
    decode: Callable[[list[int]], str]

    @classmethod
    def build(cls, grammar: ParserGrammar, tokenizer: Tokenizer) -> GrammarForTokenizer:
        terminal_of_id = {
            token_id: name
            for name, text in grammar.token_id_terminals.items()
            if (token_id := tokenizer.token_to_id(text)) is not None
        }
        # Special tokens the grammar does not name are dropped (vLLM's `_build_drop_info`).
        named = set(grammar.token_id_terminals.values()) | set(grammar.terminals.values())
        drops = {text: token_id for text, token_id in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids) if text not in named}
        literals = [(name, text) for name, text in grammar.terminals.items()] + [(DROP, text) for text in drops]
        terminal_of_id.update((token_id, DROP) for token_id in drops.values())
        start = grammar.token_id_terminals.get("THINK_START")
        end = grammar.token_id_terminals.get("THINK_END")
        return cls(
            grammar=grammar,
            terminal_of_id=terminal_of_id,
            has_drops=bool(drops),
            lexer_shape=LexerShape(literals),
            start_token_id=None if start is None else tokenizer.token_to_id(start),
            end_token_id=None if end is None else tokenizer.token_to_id(end),
            reasoning_end_token_ids=_reasoning_end_token_ids(grammar, tokenizer),
            turn_boundary_ids=frozenset(
                token_id for text in grammar.turn_boundary_tokens if (token_id := tokenizer.token_to_id(text)) is not None
            ),
            tool_terminals=grammar.tool_terminals(),
            tool_exit_terminals=grammar.tool_exit_terminals(),
            decode_token=lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False),
            decode=lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=False),
        )


def _reasoning_end_token_ids(grammar: ParserGrammar, tokenizer: Tokenizer) -> frozenset[int]:
    """vLLM's `_derive_reasoning_end_token_ids`: the ids of the terminals that end the reasoning; none
    when the reasoning can also be left otherwise, or ends on a terminal into content with no id."""
    ends: dict[str, State] = {}
    for (state, terminal), tr in grammar.transitions.items():
        if state is not State.REASONING:
            continue
        if Event.REASONING_END in tr.events:
            ends.setdefault(terminal, tr.next_state)
        elif tr.next_state is not State.REASONING:
            return frozenset()
    ids: set[int] = set()
    for terminal, next_state in ends.items():
        text = grammar.token_id_terminals.get(terminal)
        token_id = None if text is None else tokenizer.token_to_id(text)
        if token_id is not None:
            ids.add(token_id)
        elif next_state is State.CONTENT:
            return frozenset()
    return frozenset(ids)

"""`qwen3`: vLLM 0.32's `Qwen3Parser` (`vllm/parser/qwen3.py`) as its reasoning parser.

Its grammar: the answer starts in the reasoning (unless the request's `chat_template_kwargs` say
`enable_thinking: false`), `<think>` there is dropped, `</think>` ends it (and is dropped again after
it), and a `<tool_call>` ends it too, staying in the content. `<tool_call>`, `</tool_call>`, `<think>` and
`</think>` are recognised by id where the tokenizer has them as tokens; the rest of the tool-call markup
is text, which vLLM's reasoning adapter leaves as such. The ChatML turn boundaries tell where the
prompt's last turn starts.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from mmserve.text import Tokenizer

from .grammar import Event, GrammarForTokenizer, ParserGrammar, State, Transition
from .parser_engine import EngineReasoningParser

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"

_R, _C = State.REASONING, State.CONTENT
_TRANSITIONS = {
    (_R, "THINK_START"): Transition(_R),
    (_R, "THINK_END"): Transition(_C, (Event.REASONING_END,)),
    (_C, "THINK_END"): Transition(_C),  # a second </think> is dropped
    (_R, "TOOL_START"): Transition(State.TOOL_PREAMBLE, (Event.REASONING_END, Event.TOOL_CALL_START)),
    (_C, "TOOL_START"): Transition(State.TOOL_PREAMBLE, (Event.REASONING_END, Event.TOOL_CALL_START)),
    (_C, "FUNC_PREFIX"): Transition(State.TOOL_NAME, (Event.TOOL_CALL_START,)),
    (State.TOOL_PREAMBLE, "TOOL_END"): Transition(_C, (Event.TOOL_CALL_END,)),
    (State.TOOL_PREAMBLE, "FUNC_PREFIX"): Transition(State.TOOL_NAME),
    (State.TOOL_NAME, "CLOSE_ANGLE"): Transition(State.TOOL_ARGS),
    (State.TOOL_NAME, "FUNC_END"): Transition(State.TOOL_BETWEEN, (Event.TOOL_CALL_END,)),
    (State.TOOL_ARGS, "FUNC_END"): Transition(State.TOOL_BETWEEN, (Event.TOOL_CALL_END,)),
    (State.TOOL_ARGS, "PARAM_START"): Transition(State.TOOL_ARGS, (Event.ARG_VALUE_CHUNK,)),
    (State.TOOL_ARGS, "PARAM_END"): Transition(State.TOOL_ARGS, (Event.ARG_VALUE_CHUNK,)),
    (State.TOOL_BETWEEN, "TOOL_END"): Transition(_C),
    (State.TOOL_BETWEEN, "TOOL_START"): Transition(State.TOOL_PREAMBLE, (Event.TOOL_CALL_START,)),
    (State.TOOL_BETWEEN, "FUNC_PREFIX"): Transition(State.TOOL_NAME, (Event.TOOL_CALL_START,)),
}


@cache
def qwen3_grammar(thinking: bool) -> ParserGrammar:
    """vLLM's `qwen3_config(thinking)`."""
    return ParserGrammar(
        name="qwen3",
        terminals={
            "THINK_START": THINK_START,
            "THINK_END": THINK_END,
            "TOOL_START": TOOL_CALL_START,
            "TOOL_END": TOOL_CALL_END,
            "FUNC_PREFIX": "<function=",
            "FUNC_END": "</function>",
            "PARAM_START": "<parameter=",
            "PARAM_END": "</parameter>",
            "CLOSE_ANGLE": ">",
        },
        token_id_terminals={
            "THINK_START": THINK_START,
            "THINK_END": THINK_END,
            "TOOL_START": TOOL_CALL_START,
            "TOOL_END": TOOL_CALL_END,
        },
        transitions=_TRANSITIONS,
        initial_state=State.REASONING if thinking else State.CONTENT,
        wait_for_reasoning=thinking,
        turn_boundary_tokens=frozenset(("<|im_start|>", "<|im_end|>")),
    )  # (vLLM's config also sets strip_trailing_reasoning_whitespace=False: what grammar.py serves)


class Qwen3ReasoningSetup:
    """The `qwen3` parser for one model's tokenizer: its grammar bound to it, with and without thinking."""

    name = "qwen3"
    engine_based = True

    def __init__(self, tokenizer: Tokenizer) -> None:
        # A tokenizer without the tags as tokens is taken, as vLLM takes it: its terminals are then
        # recognised by their text alone, and no prompt ends the reasoning.
        self._bound = {thinking: GrammarForTokenizer.build(qwen3_grammar(thinking), tokenizer) for thinking in (True, False)}

    def parser(self, chat_template_kwargs: dict[str, Any] | None = None) -> Qwen3ReasoningParser:
        thinking = bool((chat_template_kwargs or {}).get("enable_thinking", True))
        return Qwen3ReasoningParser(self._bound[thinking], thinking)


class Qwen3ReasoningParser(EngineReasoningParser):
    """vLLM's `Qwen3ParserReasoningAdapter`."""

    def __init__(self, bound: GrammarForTokenizer, thinking: bool) -> None:
        super().__init__(bound)
        self.thinking = thinking

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        if not self.thinking:
            self._streaming_count_valid = False
            return None, model_output
        return super().extract_reasoning(model_output)

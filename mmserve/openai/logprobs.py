"""Logprobs: the engine's rows of (token id, logprob) → OpenAI's chat and completions `logprobs` and vLLM's `prompt_logprobs`, as vLLM renders them.

vLLM 0.32's output processor (`vllm/v1/engine/logprobs.py`) turns each row into a dict
{token id: Logprob}: the sampled token first, then the top-k (a sampled token that is also in
the top-k keeps its first place and takes its top-k entry), each token string decoded on its own
(`convert_ids_list_to_tokens`), a string ending in U+FFFD re-decoded with up to four preceding
sampled tokens (`_correct_decoded_token`). Its chat server (`_create_chat_logprobs`) then lists,
per token, the sampled entry and the first `top_logprobs` entries of that dict, each logprob
floored at -9999.0. Prompt logprobs (`_update_prompt_logprobs`) are built the same way from the
prompt's rows, with the prompt token's rank, the four preceding prompt tokens as the context of a
string ending in U+FFFD, None for the first position, and -inf shown as -9999.0
(`clamp_prompt_logprobs`); the responses show each position's whole dict.
"""

from __future__ import annotations

import json

import msgspec
import numpy as np

from mmserve.text import Tokenizer
from mmserve.wire import LogprobsLists, LogprobsTensors

REPLACEMENT = "\ufffd"
LOGPROB_FLOOR = -9999.0
# Preceding sampled tokens vLLM decodes with a token ending in U+FFFD (enough for any UTF-8 sequence).
MAX_CONTEXT_TOKENS = 4


class TopLogprob(msgspec.Struct):
    """Mirrors vLLM's `ChatCompletionLogProb`."""

    token: str
    logprob: float = LOGPROB_FLOOR
    bytes: list[int] | None = None


class TokenLogprob(msgspec.Struct):
    """Mirrors vLLM's `ChatCompletionLogProbsContent`: one generated token."""

    token: str
    logprob: float = LOGPROB_FLOOR
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class PromptLogprob(msgspec.Struct):
    """Mirrors vLLM's `Logprob` (a dataclass), as `prompt_logprobs` shows it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt position: None for the first, else {token id: its logprob}, the prompt token first.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ChatLogprobs(msgspec.Struct):
    """Mirrors vLLM's `ChatCompletionLogProbs`."""

    content: list[TokenLogprob] | None = None


class CompletionLogprobs(msgspec.Struct):
    """Mirrors vLLM's `CompletionLogProbs`."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionToken(msgspec.Struct):
    """One token as the completions API lists it: its string, its logprob and its top entries by
    string (None for the prompt's first token, which has no logprob)."""

    token: str
    logprob: float | None
    top_logprobs: dict[str, float] | None


def completion_tokens(entries: list[TokenLogprob]) -> list[CompletionToken]:
    """Sample logprobs rendered with every top entry (top_logprobs=-1): vLLM's
    `_create_completion_logprobs` lists all k + 1 entries of each token's dict, keyed by their strings."""
    return [CompletionToken(e.token, e.logprob, {top.token: top.logprob for top in e.top_logprobs}) for e in entries]


def echoed_prompt_tokens(
    prompt_ids: list[int], positions: PromptLogprobs, num_shown: int, strings: TokenStrings
) -> list[CompletionToken]:
    """The prompt's tokens as an echoing completion lists them: a position without logprobs by its
    token decoded alone, the others by their entry, each with its first `num_shown` + 1 entries (all: -1)."""
    tokens = []
    for token_id, entries in zip(prompt_ids, positions):
        if entries is None:
            tokens.append(CompletionToken(strings.decode([token_id]), None, None))
            continue
        own = entries[token_id]
        shown = [e for k, e in enumerate(entries.values()) if num_shown == -1 or k <= num_shown]
        tokens.append(CompletionToken(
            own.decoded_token or "", max(own.logprob, LOGPROB_FLOOR),
            {e.decoded_token or "": max(e.logprob, LOGPROB_FLOOR) for e in shown},
        ))
    return tokens


def completion_logprobs(tokens: list[CompletionToken], initial_text_offset: int) -> CompletionLogprobs:
    """The completions API's `logprobs`: the tokens' lists, each token's offset in the text from the
    previous tokens' string lengths."""
    offsets, offset = [], initial_text_offset
    for token in tokens:
        offsets.append(offset)
        offset += len(token.token)
    return CompletionLogprobs(
        text_offset=offsets,
        token_logprobs=[token.logprob for token in tokens],
        tokens=[token.token for token in tokens],
        top_logprobs=[token.top_logprobs for token in tokens],
    )


class TokenStrings:
    """Token strings as vLLM's logprobs show them (`convert_ids_list_to_tokens`), for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.space_marker = _leading_space_marker(tokenizer)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def one_by_one(self, token_ids: list[int]) -> list[str]:
        strings = [self.decode([token_id]) for token_id in token_ids]
        if self.space_marker is None:
            return strings
        return [
            _restore_leading_spaces(self.tokenizer.id_to_token(token_id) or "", text, self.space_marker)
            for token_id, text in zip(token_ids, strings)
        ]

    def position_strings(self, ids: list[int], context: list[int]) -> list[str]:
        """The strings of one position's token ids (the sampled or prompt token, then the top-k), a string
        ending in U+FFFD re-decoded with the preceding tokens `context` (vLLM's `_verify_tokens`)."""
        strings = self.one_by_one(ids)
        for k, text in enumerate(strings):
            if text.endswith(REPLACEMENT):
                strings[k] = self.corrected(ids[k], context[-MAX_CONTEXT_TOKENS:])
        return strings

    def corrected(self, token_id: int, context: list[int]) -> str:
        """vLLM's `_correct_decoded_token`: the text this token completes, given the sampled tokens before it."""
        for num_context in range(1, min(len(context), MAX_CONTEXT_TOKENS) + 1):
            window = context[-num_context:]
            full = self.decode(window + [token_id])
            if full.endswith(REPLACEMENT):
                continue
            clean_end = len(window)
            for j in range(len(window) - 1, -1, -1):
                if self.decode([window[j]]).endswith(REPLACEMENT):
                    clean_end = j
                else:
                    break
            prefix = self.decode(window[:clean_end]) if clean_end > 0 else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0
            for a, b in zip(prefix, full):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""


class ChoiceLogprobs:
    """One choice's sample logprobs, rendered token by token as they arrive."""

    def __init__(self, strings: TokenStrings, top_logprobs: int) -> None:
        self.strings = strings
        self.top_logprobs = top_logprobs
        # The sampled tokens so far, most recent last: the context of a token ending in U+FFFD.
        self.sampled: list[int] = []

    def render(self, rows: LogprobsLists, num_tokens: int) -> list[TokenLogprob]:
        """The first `num_tokens` rows (the tokens kept after stop strings), rendered."""
        token_ids: np.ndarray = rows.logprob_token_ids.array()[:num_tokens]
        values: np.ndarray = rows.logprobs.array()[:num_tokens]
        rendered = []
        for ids, logprobs in zip(token_ids.tolist(), values.tolist()):
            strings = self.strings.position_strings(ids, self.sampled)
            # {token id: (logprob, string)}: the sampled token's place, the last entry's values.
            entries: dict[int, tuple[float, str]] = {}
            for token_id, logprob, text in zip(ids, logprobs, strings):
                entries[token_id] = (logprob, text)
            sampled_logprob, sampled_text = entries[ids[0]]
            count = len(entries) if self.top_logprobs == -1 else self.top_logprobs
            top = [
                TopLogprob(text, max(logprob, LOGPROB_FLOOR), list(text.encode("utf-8", errors="replace")))
                for _, (logprob, text) in zip(range(count), entries.values())
            ]
            rendered.append(TokenLogprob(
                sampled_text, max(sampled_logprob, LOGPROB_FLOOR),
                list(sampled_text.encode("utf-8", errors="replace")), top,
            ))
            self.sampled.append(ids[0])
        return rendered


class PromptLogprobsCollector:
    """One request's prompt logprobs, collected from the chunks the engine sends while it prefills."""

    def __init__(self, strings: TokenStrings) -> None:
        self.strings = strings
        self.positions: PromptLogprobs = [None]
        # The prompt tokens of the positions so far, most recent last (the first position has none).
        self._prompt_tokens: list[int] = []

    def add(self, chunk: LogprobsTensors) -> None:
        token_ids = chunk.logprob_token_ids.array().tolist()
        values = chunk.logprobs.array().tolist()
        ranks = chunk.selected_token_ranks.array().tolist()
        for ids, logprobs, rank in zip(token_ids, values, ranks):
            strings = self.strings.position_strings(ids, self._prompt_tokens)
            # The prompt token first with its rank, then the top-k ranked 1..k; a prompt token that is
            # also in the top-k keeps its first place and takes its top-k entry (a dict, as vLLM's).
            entries: dict[int, PromptLogprob] = {}
            for k, (token_id, logprob, text) in enumerate(zip(ids, logprobs, strings)):
                shown = LOGPROB_FLOOR if logprob == float("-inf") else logprob
                entries[token_id] = PromptLogprob(shown, rank if k == 0 else k, text)
            self.positions.append(entries)
            self._prompt_tokens.append(ids[0])


def _leading_space_marker(tokenizer: Tokenizer) -> str | None:
    """vLLM's `get_leading_space_marker`: the Metaspace replacement character, if the tokenizer has one."""
    try:
        pre = json.loads(tokenizer.backend.to_str()).get("pre_tokenizer") or {}
    except ValueError:
        return None
    if pre.get("type") == "Metaspace":
        return pre.get("replacement", "\u2581")
    if pre.get("type") == "Sequence":
        for sub in pre.get("pretokenizers", []):
            if sub.get("type") == "Metaspace":
                return sub.get("replacement", "\u2581")
    return None


def _restore_leading_spaces(raw_token: str, text: str, marker: str) -> str:
    """vLLM's `_restore_leading_spaces`: the spaces `decode` stripped from a raw vocab piece."""
    num_markers = len(raw_token) - len(raw_token.lstrip(marker))
    if num_markers == 0:
        return text
    missing = num_markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text

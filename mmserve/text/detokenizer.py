"""Per-sequence incremental detokenization, identical to vLLM's
``FastIncrementalDetokenizer.decode_next`` (vllm/v1/engine/detokenizer.py).

The Rust ``DecodeStream`` keeps a small window of pending ids and only emits
text once it forms valid UTF-8, so a multi-byte character split across tokens
is emitted whole by the token that completes it (never U+FFFD mid-character),
and each step costs O(window) rather than re-decoding the sequence.
It is primed with the prompt ids, so e.g. a leading-space marker on the first
generated token is decoded as it would be mid-text.
"""

from __future__ import annotations

import logging

import tokenizers
import tokenizers.decoders

from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# tokenizers' error when a decoder produced non-monotonic / invalid UTF-8 output
# (vLLM issue #17448); vLLM recovers by restarting the stream without context.
_INVALID_PREFIX_ERR_MSG = "Invalid prefix encountered"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int] | None = None,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._backend: tokenizers.Tokenizer = tokenizer.backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = tokenizers.decoders.DecodeStream(
            ids=list(prompt_token_ids or ()), skip_special_tokens=skip_special_tokens
        )
        # vLLM only special-cases spaces when special tokens are both kept and
        # requested unspaced: consecutive added tokens are then emitted as their
        # raw content (the decoder could otherwise prefix a space, e.g. Metaspace).
        self._added_token_text: dict[int, str] | None = None
        self._last_was_added = False
        if not (skip_special_tokens or spaces_between_special_tokens):
            added = {tid: tok.content for tid, tok in tokenizer.added_tokens.items()}
            self._added_token_text = added or None

    def decode_next(self, token_id: int) -> str:
        """Text newly completed by ``token_id`` (possibly "")."""
        text = self._step(token_id)
        if self._added_token_text is not None:
            added = self._added_token_text.get(token_id)
            if added is not None and self._last_was_added:
                text = added
            self._last_was_added = added is not None
        return text or ""

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except (OverflowError, TypeError):
            # vLLM logs and drops an id the tokenizer cannot represent.
            logger.exception("Encountered invalid token id: %r", token_id)
            return None
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX_ERR_MSG):
                raise
            logger.warning("Invalid prefix detokenization error, resetting decode stream")
            self._stream = tokenizers.decoders.DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._backend, token_id)

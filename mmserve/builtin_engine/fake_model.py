"""The built-in engine's fake model: the model directory's tokenizer and token ids, and the
deterministic answer stream (proof lines for multimodal items, then readable sentences)."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..model_files import ModelConfig
from .scheduler import GenerationRequest
from .settings import BuiltinEngineSettings
from .structured import GrammarFollower, vocab_of
from .wire_engine_side import ReceivedRequest

logger = logging.getLogger("mmserve.builtin_engine")


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


_WORDS = (
    "the a quiet bright small river mountain lantern garden window morning evening signal engine "
    "token answer question picture image color light shadow stone paper cloud ocean forest road "
    "city bridge tower market letter number pattern circle square line corner edge surface "
    "detail shows holds carries follows reaches turns waits sees finds keeps brings makes "
    "slowly clearly softly nearly always often again together beyond under above between "
    "red blue green golden silver gray warm cold calm steady simple gentle careful curious "
    "is are was were has have with from into over near and but so because while then"
).split()

_SKIP_PROMPT_WORDS = frozenset(
    "system user assistant you are helpful the and for with this that what which who how "
    "please describe image picture vision".split()
)


@dataclass(frozen=True)
class ModelInfo:
    tokenizer: Any | None  # tokenizers.Tokenizer
    image_token_id: int
    video_token_id: int
    merge_size: int
    vocab_size: int
    special_ids: frozenset[int]

    @classmethod
    def load(cls, model_dir: Path) -> ModelInfo:
        if not (model_dir / "config.json").is_file():
            logger.warning("no config.json in %s: using Qwen2-VL default token ids", model_dir)
        config = ModelConfig.load(model_dir)
        tokenizer = None
        special: set[int] = set()
        tok_path = model_dir / "tokenizer.json"
        if tok_path.is_file():
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(tok_path))
            special = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
        else:
            logger.warning("no tokenizer.json in %s: answering with token ids only", model_dir)
        return cls(
            tokenizer=tokenizer,
            image_token_id=_or(config.token_id("image_token_id"), 151655),
            video_token_id=_or(config.token_id("video_token_id"), 151656),
            merge_size=_or(config.vision_merge_size, 2),
            vocab_size=_or(config.vocab_size, 1000),
            special_ids=frozenset(special),
        )

    def encode(self, text: str) -> list[int]:
        assert self.tokenizer is not None
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def prompt_words(self, prompt: list[int]) -> list[str]:
        """Distinct words of the prompt's text (last ones first), to echo in answers."""
        if self.tokenizer is None:
            return []
        ids = [t for t in prompt[-512:] if t not in self.special_ids and 0 <= t < self.vocab_size]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        seen: dict[str, None] = {}
        for word in reversed(re.findall(r"[A-Za-z]{3,}", text)):
            w = word.lower()
            if w not in _SKIP_PROMPT_WORDS:
                seen.setdefault(w, None)
            if len(seen) >= 12:
                break
        return list(seen)


def answer_stream(model: ModelInfo, rng: random.Random, prefix: str, prompt_words: list[str]) -> Iterator[int]:
    """Ordinary (non-special) token ids, forever: the proof lines, then sentences."""
    if model.tokenizer is None:
        limit = min(model.vocab_size, min(model.special_ids, default=model.vocab_size)) or 1000
        while True:
            yield rng.randrange(limit)
    if prefix:
        yield from model.encode(prefix)
    first = True
    while True:
        n = rng.randint(5, 11)
        words = [
            rng.choice(prompt_words) if prompt_words and rng.random() < 0.25 else rng.choice(_WORDS)
            for _ in range(n)
        ]
        sentence = " ".join(words).capitalize() + rng.choice("...!?")[0]
        yield from model.encode(sentence if first else " " + sentence)
        first = False


def new_generation(model: ModelInfo, settings: BuiltinEngineSettings, req: ReceivedRequest, lines: list[str]) -> GenerationRequest:
    """The request's answer: a PRNG keyed by the prompt and its items (and the seed of a sampled
    request), the proof lines first, a natural length, then EOS unless ignored."""
    s = req.sampling
    assert s is not None
    prompt = req.prompt_token_ids
    if s.temperature > 0 and s.seed is None:
        key = os.urandom(16)
    else:
        h = hashlib.sha256()
        h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in prompt))
        for feature in req.mm_features:
            h.update(feature.identifier.encode() + b"\0")
        if s.temperature > 0:
            h.update(f"seed={s.seed}".encode())
        key = h.digest()
    rng = random.Random(key)
    prefix = "".join(line + "\n" for line in lines)
    stream = answer_stream(model, rng, prefix, model.prompt_words(prompt))
    prefix_tokens = len(model.encode(prefix)) if prefix and model.tokenizer is not None else 0
    natural = prefix_tokens + rng.randint(settings.min_answer_tokens, settings.max_answer_tokens)
    room = settings.max_model_len - len(prompt)
    constraint = None
    if s.structured_outputs is not None:
        if model.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer.json")
        eos = None if s.ignore_eos else s.eos_token_id
        stops = frozenset(s.all_stop_token_ids)
        vocab = vocab_of(model.tokenizer, model.vocab_size, tuple(sorted(stops)))
        constraint = GrammarFollower(vocab, vocab.compile(s.structured_outputs), eos, stops)
    return GenerationRequest(
        request_id=req.request_id,
        client_index=req.client_index,
        prompt_len=len(prompt),
        max_tokens=room if s.max_tokens is None else max(1, s.max_tokens),
        min_tokens=max(0, s.min_tokens),
        eos=None if s.ignore_eos else s.eos_token_id,
        stop_ids=frozenset(s.stop_token_ids),
        all_stop_ids=frozenset(s.all_stop_token_ids),
        natural_len=natural,
        stream=stream,
        constraint=constraint,
    )

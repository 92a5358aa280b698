"""Incremental detokenization vs vLLM's FastIncrementalDetokenizer."""

from __future__ import annotations

import random
from pathlib import Path

from mmserve.model_files import ModelFiles
from mmserve.text import IncrementalDetokenizer, Tokenizer

from tests.text.vllm_reference_text import MULTIBYTE, random_ids as _random_ids, vllm_detokenizer as _vllm_detokenizer


def test_multibyte_stream_never_emits_replacement_char(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_model_files(ModelFiles.load(model_dir))
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    assert len(ids) > len(MULTIBYTE) // 2  # really split into byte pieces
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:", add_special_tokens=False))
    deltas = [detok.decode_next(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas).strip() == MULTIBYTE


def test_detokenizer_matches_vllm_random(model_dir: Path, hf_tokenizer, corpus: list[str]) -> None:
    tokenizer = Tokenizer.from_model_files(ModelFiles.load(model_dir))
    pool = tokenizer.encode(" ".join(corpus) + MULTIBYTE, add_special_tokens=False)
    special = sorted(tokenizer.added_tokens)
    rng = random.Random(1234)
    for case in range(300):
        prompt = _random_ids(rng, tokenizer, pool, special, rng.randint(0, 8))
        output = _random_ids(rng, tokenizer, pool, special, rng.randint(1, 40))
        params = dict(
            skip_special_tokens=rng.random() < 0.7,
            spaces_between_special_tokens=rng.random() < 0.5,
        )
        ours = IncrementalDetokenizer(tokenizer, prompt, **params)
        ref = _vllm_detokenizer(hf_tokenizer, prompt, **params)
        for token_id in output:
            assert ours.decode_next(token_id) == ref.decode_next(token_id), (case, prompt, output, params)

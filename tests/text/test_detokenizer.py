"""Incremental detokenization vs vLLM's FastIncrementalDetokenizer."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

from mmserve.text import IncrementalDetokenizer, Tokenizer

MULTIBYTE = "你好，世界！😀🎉👍🏽 Straße こんにちは 🇫🇷 naïve"


def _vllm_detokenizer(hf_tokenizer, prompt_ids: list[int], **params):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    request = SimpleNamespace(request_id="r", sampling_params=SamplingParams(**params), prompt_token_ids=prompt_ids)
    return FastIncrementalDetokenizer(hf_tokenizer, request)


def _random_ids(rng: random.Random, tokenizer: Tokenizer, pool: list[int], special: list[int], n: int) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        r = rng.random()
        if r < 0.1 and special:
            out.append(rng.choice(special))
        elif r < 0.4:
            # A run of real text so multi-byte chars are split across byte tokens.
            start = rng.randrange(len(pool))
            out.extend(pool[start : start + rng.randint(1, 6)])
        else:
            out.append(rng.randrange(tokenizer.vocab_size))
    return out[:n]


def test_multibyte_stream_never_emits_replacement_char(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(model_dir)
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    assert len(ids) > len(MULTIBYTE) // 2  # really split into byte pieces
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:", add_special_tokens=False))
    deltas = [detok.decode_next(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas).strip() == MULTIBYTE


def test_detokenizer_matches_vllm_random(model_dir: Path, hf_tokenizer, corpus: list[str]) -> None:
    tokenizer = Tokenizer.from_dir(model_dir)
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

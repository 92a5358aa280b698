"""Shared by the text tests: vLLM's own detokenizer, and random token streams that split
multi-byte characters across byte tokens."""

from __future__ import annotations

import random
from types import SimpleNamespace

from mmserve.text import Tokenizer

MULTIBYTE = "你好，世界！😀🎉👍🏽 Straße こんにちは 🇫🇷 naïve"


def vllm_detokenizer(hf_tokenizer, prompt_ids: list[int], **params):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    request = SimpleNamespace(request_id="r", sampling_params=SamplingParams(**params), prompt_token_ids=prompt_ids)
    return FastIncrementalDetokenizer(hf_tokenizer, request)


def random_ids(rng: random.Random, tokenizer: Tokenizer, pool: list[int], special: list[int], n: int) -> list[int]:
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

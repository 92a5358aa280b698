"""Stop strings / stop tokens vs vLLM (FastIncrementalDetokenizer.update +
get_next_output_text, check_stop_strings, scheduler check_stop)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

from mmserve.model_files import ModelFiles
from mmserve.text import (
    IncrementalDetokenizer,
    SequenceText,
    Tokenizer,
    check_stop_strings,
    resolve_stop_token_ids,
    stop_token_reason,
)

from tests.text.vllm_reference_text import MULTIBYTE, random_ids as _random_ids, vllm_detokenizer as _vllm_detokenizer


def _ours(tokenizer: Tokenizer, prompt_ids: list[int], **params) -> SequenceText:
    detok = IncrementalDetokenizer(
        tokenizer,
        prompt_ids,
        skip_special_tokens=params.get("skip_special_tokens", True),
        spaces_between_special_tokens=params.get("spaces_between_special_tokens", True),
    )
    return SequenceText(
        detok,
        stop=params.get("stop"),
        include_stop_str_in_output=params.get("include_stop_str_in_output", False),
        min_tokens=params.get("min_tokens", 0),
    )


def _stop_strings_from(rng: random.Random, text: str) -> list[str]:
    stops: list[str] = []
    for _ in range(rng.randint(1, 3)):
        if text and rng.random() < 0.8:
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randint(1, 6)])
        else:
            stops.append(rng.choice(["###", "\n\n", "END", "😀", "zzz"]))
    return [s for s in stops if s] or ["###"]


def test_sequence_text_matches_vllm_random(model_dir: Path, hf_tokenizer, corpus: list[str]) -> None:
    """Stop strings, hold-back, min_tokens, EOS exclusion, multi-token steps."""
    tokenizer = Tokenizer.from_model_files(ModelFiles.load(model_dir))
    pool = tokenizer.encode(" ".join(corpus) + MULTIBYTE, add_special_tokens=False)
    special = sorted(tokenizer.added_tokens)
    eos = tokenizer.eos_token_id
    rng = random.Random(99)
    matched = 0
    for case in range(400):
        prompt = _random_ids(rng, tokenizer, pool, special, rng.randint(0, 6))
        output = _random_ids(rng, tokenizer, pool, special, rng.randint(1, 50))
        stop_terminated_at_end = rng.random() < 0.5
        if stop_terminated_at_end and eos is not None and rng.random() < 0.7:
            output.append(eos)
        full_text = tokenizer.decode(output)
        params = dict(
            stop=_stop_strings_from(rng, full_text) if rng.random() < 0.85 else None,
            include_stop_str_in_output=rng.random() < 0.3,
            min_tokens=rng.choice([0, 0, 1, 3, 10]),
            skip_special_tokens=rng.random() < 0.8,
        )
        ref = _vllm_detokenizer(hf_tokenizer, prompt, **params)
        ours = _ours(tokenizer, prompt, **params)
        i = 0
        ours_deltas, ref_deltas = [], []
        while i < len(output):
            step = output[i : i + rng.choice([1, 1, 1, 2, 3, 5])]
            i += len(step)
            last = i >= len(output)
            stop_terminated = last and stop_terminated_at_end
            ref_stop = ref.update(list(step), stop_terminated)
            our_stop = ours.update(list(step), stop_terminated)
            ctx = (case, prompt, output, params)
            assert our_stop == ref_stop, ctx
            finished = last or ref_stop is not None
            ref_deltas.append(ref.get_next_output_text(finished, delta=True))
            ours_deltas.append(ours.next_delta(finished))
            assert ours_deltas == ref_deltas, ctx
            assert ours.token_ids == ref.output_token_ids, ctx
            assert ours.text(finished) == ref.get_next_output_text(finished, delta=False), ctx
            if ref_stop is not None:
                matched += 1
                break
        # A stop string never leaks into streamed text unless requested.
        if params["stop"] and not params["include_stop_str_in_output"] and ref_stop is not None:
            assert "".join(ours_deltas) == ours.output_text
    assert matched > 50  # the random cases really exercise stop strings


def test_check_stop_strings_matches_vllm_random() -> None:
    from vllm.v1.engine.detokenizer import check_stop_strings as ref_check

    rng = random.Random(7)
    alphabet = "ab c\n😀你"
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        new_chars = rng.randint(0, len(text))
        include = rng.random() < 0.5
        assert check_stop_strings(text, new_chars, stops, include) == ref_check(text, new_chars, stops, include)


def test_stop_token_reason_matches_vllm_scheduler() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.utils import check_stop

    rng = random.Random(3)
    for _ in range(300):
        request_ids = rng.sample(range(10), rng.randint(0, 3))
        ignore_eos = rng.random() < 0.3
        stop = resolve_stop_token_ids(
            tokenizer_eos_token_id=rng.choice([None, 1, 2]),
            generation_eos_token_ids=tuple(rng.sample(range(5), rng.randint(0, 2))),
            request_stop_token_ids=request_ids,
            ignore_eos=ignore_eos,
        )
        params = SamplingParams(stop_token_ids=list(request_ids), ignore_eos=ignore_eos, max_tokens=100)
        params._eos_token_id = stop.eos_token_id
        params.stop_token_ids = stop.stop_token_ids
        token = rng.randrange(10)
        request = SimpleNamespace(
            pooling_params=None, sampling_params=params, output_token_ids=[token], num_tokens=5,
            num_output_tokens=1, max_tokens=100, status=None, stop_reason=None,
        )  # fmt: skip
        stopped = check_stop(request, max_model_len=1000)
        assert stop_token_reason(token, stop) == (stopped, request.stop_reason)

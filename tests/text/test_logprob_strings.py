"""Chat logprobs and prompt logprobs rendered from the engine's rows equal vLLM's own rendering (its `LogprobsProcessor`
and its chat server's `_create_chat_logprobs`) for every tokenizer family we serve: token strings
(byte-level pieces, Metaspace leading spaces, U+FFFD re-decoded with the preceding sampled tokens),
bytes, values, the floor at -9999 and the order of the top entries (the sampled token first, also
when it is not the most likely one). Reference test: vLLM and transformers run in-process."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from mmserve.model_files import ModelFiles
from mmserve.openai.logprobs import ChoiceLogprobs, PromptLogprobsCollector, TokenStrings
from mmserve.text import Tokenizer
from mmserve.wire import LogprobsLists, LogprobsTensors, OutputTensor, WireArray
from tests.text.vllm_reference_text import MULTIBYTE, random_ids


def _wire(array: np.ndarray) -> WireArray:
    return WireArray(array.dtype.str, list(array.shape), array.tobytes())


def _vllm_chat_logprobs(hf_tokenizer, rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]], top_logprobs: int) -> list[dict]:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists as VllmLogprobsLists

    request = SimpleNamespace(sampling_params=SamplingParams(logprobs=top_logprobs))
    processor = LogprobsProcessor.from_new_request(hf_tokenizer, request)
    sampled = []
    for ids, values, ranks in rows:
        processor.update_from_output(SimpleNamespace(
            new_logprobs=VllmLogprobsLists(ids, values, ranks), new_prompt_logprobs_tensors=None, prompt_token_id_logprobs=None,
        ))
        sampled += ids[:, 0].tolist()
    server = SimpleNamespace(return_tokens_as_token_ids=False, _get_decoded_token=OpenAIServingChat._get_decoded_token)
    server._get_top_logprobs = lambda *args, **kwargs: OpenAIServingChat._get_top_logprobs(server, *args, **kwargs)
    rendered = OpenAIServingChat._create_chat_logprobs(
        server, token_ids=sampled, top_logprobs=processor.logprobs, tokenizer=hf_tokenizer, num_output_top_logprobs=top_logprobs,
    )
    return rendered.model_dump()["content"]


@pytest.mark.parametrize("top_logprobs", [0, 1, 3])
def test_chat_logprobs_render_as_vllm_renders_them(model_dir: Path, hf_tokenizer, corpus: list[str], top_logprobs: int) -> None:
    tokenizer = Tokenizer.from_model_files(ModelFiles.load(model_dir))
    pool = tokenizer.encode(" ".join(corpus[:50]) + MULTIBYTE, add_special_tokens=False)
    special = sorted(tokenizer.added_tokens)
    rng = random.Random(top_logprobs)
    for case in range(40):
        sampled = random_ids(rng, tokenizer, pool, special, rng.randint(1, 24))
        rows, position = [], 0
        while position < len(sampled):
            steps = sampled[position : position + rng.choice([1, 1, 2])]  # an engine step may bring several tokens
            position += len(steps)
            ids = np.array([[token] + random_ids(rng, tokenizer, pool, special, top_logprobs) for token in steps], dtype=np.int32)
            if rng.random() < 0.5 and top_logprobs:
                ids[:, 1] = ids[:, 0]  # the sampled token is also the most likely one
            values = np.array(rng.choices([-0.5, -1e-3, -12.25, -20000.0, float(-np.inf)], k=ids.size), np.float32).reshape(ids.shape)
            rows.append((ids, values, np.arange(1, len(steps) + 1, dtype=np.int64)))
        choice = ChoiceLogprobs(TokenStrings(tokenizer), top_logprobs)
        ours = []
        for ids, values, ranks in rows:
            ours += choice.render(LogprobsLists(_wire(ids), _wire(values), _wire(ranks)), len(ids))
        assert msgspec.to_builtins(ours) == _vllm_chat_logprobs(hf_tokenizer, rows, top_logprobs), (case, rows)


def _tensor(array: np.ndarray) -> OutputTensor:
    return OutputTensor(str(array.dtype), list(array.shape), array.tobytes())


def _vllm_prompt_logprobs(hf_tokenizer, chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]], prompt_logprobs: int) -> list:
    import torch
    from vllm.entrypoints.generate.base.serving import clamp_prompt_logprobs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsTensors as VllmLogprobsTensors

    request = SimpleNamespace(sampling_params=SamplingParams(prompt_logprobs=prompt_logprobs))
    processor = LogprobsProcessor.from_new_request(hf_tokenizer, request)
    for ids, values, ranks in chunks:
        processor.update_from_output(SimpleNamespace(
            new_logprobs=None, prompt_token_id_logprobs=None,
            new_prompt_logprobs_tensors=VllmLogprobsTensors(torch.from_numpy(ids), torch.from_numpy(values), torch.from_numpy(ranks)),
        ))
    positions = clamp_prompt_logprobs(processor.pop_prompt_logprobs())
    return [
        None if entries is None else [(token_id, e.logprob, e.rank, e.decoded_token) for token_id, e in entries.items()]
        for entries in positions
    ]


@pytest.mark.parametrize("prompt_logprobs", [0, 2, 5])
def test_prompt_logprobs_render_as_vllm_renders_them(model_dir: Path, hf_tokenizer, corpus: list[str], prompt_logprobs: int) -> None:
    """Prompt logprobs from the engine's chunks (the prompt token first with its rank, then the top-k):
    vLLM's `_update_prompt_logprobs` and `clamp_prompt_logprobs`, entry for entry, in order."""
    tokenizer = Tokenizer.from_model_files(ModelFiles.load(model_dir))
    pool = tokenizer.encode(" ".join(corpus[:50]) + MULTIBYTE, add_special_tokens=False)
    special = sorted(tokenizer.added_tokens)
    rng = random.Random(100 + prompt_logprobs)
    for case in range(30):
        prompt = random_ids(rng, tokenizer, pool, special, rng.randint(2, 40))
        chunks, position = [], 1  # the first prompt token has no logprob
        while position < len(prompt):
            tokens = prompt[position : position + rng.randint(1, 12)]  # the engine prefills in chunks
            position += len(tokens)
            ids = np.array([[token] + random_ids(rng, tokenizer, pool, special, prompt_logprobs) for token in tokens], dtype=np.int64)
            if rng.random() < 0.5 and prompt_logprobs:
                ids[:, 1] = ids[:, 0]  # the prompt token is also the most likely one
            values = np.array(rng.choices([-0.5, -1e-3, -12.25, -20000.0, float(-np.inf)], k=ids.size), np.float32).reshape(ids.shape)
            ranks = np.array([rng.randint(1, 5000) for _ in tokens], dtype=np.int64)
            chunks.append((ids, values, ranks))
        collector = PromptLogprobsCollector(TokenStrings(tokenizer))
        for ids, values, ranks in chunks:
            collector.add(LogprobsTensors(_tensor(ids), _tensor(values), _tensor(ranks)))
        ours = [
            None if entries is None else [(token_id, e.logprob, e.rank, e.decoded_token) for token_id, e in entries.items()]
            for entries in collector.positions
        ]
        assert ours == _vllm_prompt_logprobs(hf_tokenizer, chunks, prompt_logprobs), (case, prompt)

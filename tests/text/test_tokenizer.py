"""Tokenizer + model-file loading vs transformers / vLLM references."""

from __future__ import annotations

import random
from pathlib import Path


from mmserve.text import ModelFiles, Tokenizer, resolve_stop_token_ids

EXTRA_TEXTS = [
    "",
    " leading space",
    "trailing space ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<s>[INST] special </s> inside",
    "mixed 你好<|image_pad|>😀 text",
    "\n\n\t tabs and\r\nnewlines",
]


def test_encode_matches_transformers(model_dir: Path, hf_tokenizer, corpus: list[str]) -> None:
    tok = Tokenizer.from_model_files(ModelFiles.load(model_dir))
    for text in corpus + EXTRA_TEXTS:
        for add_special in (False, True):
            assert tok.encode(text, add_special) == hf_tokenizer.encode(text, add_special_tokens=add_special), text


def test_special_ids_and_sizes_match_transformers(model_dir: Path, hf_tokenizer) -> None:
    tok = Tokenizer.from_model_files(ModelFiles.load(model_dir))
    assert tok.eos_token_id == hf_tokenizer.eos_token_id
    assert tok.bos_token_id == hf_tokenizer.bos_token_id
    assert tok.pad_token_id == hf_tokenizer.pad_token_id
    assert list(tok.all_special_ids) == list(hf_tokenizer.all_special_ids)
    assert list(tok.all_special_tokens) == list(hf_tokenizer.all_special_tokens)
    assert len(tok) == len(hf_tokenizer)
    for token, token_id in list(hf_tokenizer.get_vocab().items())[:200]:
        assert tok.token_to_id(token) == token_id


def test_decode_matches_transformers(model_dir: Path, hf_tokenizer) -> None:
    tok = Tokenizer.from_model_files(ModelFiles.load(model_dir))
    rng = random.Random(0)
    ids = list(hf_tokenizer.get_vocab().values())
    for _ in range(200):
        seq = [rng.choice(ids) for _ in range(rng.randint(0, 30))]
        for skip in (True, False):
            assert tok.decode(seq, skip_special_tokens=skip) == hf_tokenizer.decode(seq, skip_special_tokens=skip)


def test_model_files(model_dir: Path) -> None:
    files = ModelFiles.load(model_dir)
    assert files.chat_template is not None
    assert dict(files.tokenizer_config.named_special_tokens).get("eos_token") is not None
    assert files.generation_config.eos_token_ids or files.model_config.model_type == "llama"


def test_builtin_model_dir_ids() -> None:
    from serve_app.config import BUILTIN_MODEL_DIR

    files = ModelFiles.load(BUILTIN_MODEL_DIR)
    tok = Tokenizer.from_model_files(files)
    assert files.model_config.token_id("image_token_id") == tok.token_to_id("<|image_pad|>")
    assert files.model_config.token_id("vision_start_token_id") == tok.token_to_id("<|vision_start|>")
    assert files.chat_template.origin == "chat_template.json"  # processor template wins


def test_generation_config_vs_vllm(model_dir: Path, hf_tokenizer) -> None:
    """Stop ids as vLLM's SamplingParams.update_from_generation_config makes them."""
    from transformers import GenerationConfig
    from vllm.sampling_params import SamplingParams

    try:
        gen_fields = GenerationConfig.from_pretrained(str(model_dir)).to_diff_dict()
    except OSError:
        gen_fields = {}
    files = ModelFiles.load(model_dir)
    defaults = files.generation_config.sampling_defaults
    for key in ("temperature", "top_k", "top_p"):
        assert getattr(defaults, key) == gen_fields.get(key)

    for request_ids in ([], [5], [7, 3], [hf_tokenizer.eos_token_id]):
        for ignore_eos in (False, True):
            params = SamplingParams(stop_token_ids=list(request_ids), ignore_eos=ignore_eos)
            params.update_from_generation_config(gen_fields, hf_tokenizer.eos_token_id)
            ours = resolve_stop_token_ids(
                tokenizer_eos_token_id=Tokenizer.from_model_files(files).eos_token_id,
                generation_eos_token_ids=files.generation_config.eos_token_ids,
                request_stop_token_ids=list(request_ids),
                ignore_eos=ignore_eos,
            )
            assert ours.eos_token_id == params.eos_token_id
            assert ours.stop_token_ids == params.stop_token_ids
            assert ours.all_stop_token_ids == params.all_stop_token_ids

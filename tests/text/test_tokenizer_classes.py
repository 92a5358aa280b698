"""Token ids exactly as vLLM loads the tokenizer (transformers 5's AutoTokenizer), for every tokenizer
class of the families we serve, with tokenizer.json files that agree with the class and files that do
not (tests/text/tokenizer_dirs.py); on a generated corpus of 10 000 strings (tokenizer_corpus.py).
Decoding and vLLM's incremental detokenizer too. Classes we cannot reproduce are refused at load."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from mmserve.text import IncrementalDetokenizer, ModelFiles, Tokenizer
from mmserve.tokenizer_files import TokenizerClass, UnsupportedTokenizerError, resolve_tokenizer_class

from tests.text.tokenizer_corpus import generate_corpus
from tests.text.tokenizer_dirs import REFUSED, VARIANTS, llava_agree, qwen2_vl_agree
from tests.text.vllm_reference_text import MULTIBYTE, random_ids, vllm_detokenizer

CORPUS_SIZE = 10_000


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = VARIANTS[request.param](tmp_path_factory.mktemp(request.param))
    from vllm.tokenizers import get_tokenizer

    hf = get_tokenizer(str(path))  # vLLM's loader: AutoTokenizer.from_pretrained + its cache wrapper
    return request.param, path, hf, Tokenizer.from_model_files(ModelFiles.load(path))


def _corpus_for(hf) -> list[str]:
    specials = sorted({tok.content for tok in hf.added_tokens_decoder.values()} | set(hf.all_special_tokens))
    return generate_corpus(specials, n=CORPUS_SIZE, seed=12)


def test_class_is_the_one_transformers_loads(variant) -> None:
    name, path, hf, tok = variant
    files = ModelFiles.load(path)
    assert type(hf).__name__.removeprefix("Cached") == files.tokenizer_class.value, name


def test_ids_equal_transformers_on_corpus(variant) -> None:
    name, _, hf, tok = variant
    corpus = _corpus_for(hf)
    assert len(corpus) >= CORPUS_SIZE
    for add_special in (False, True):
        ours = tok.encode_batch(corpus, add_special_tokens=add_special)
        theirs = hf(corpus, add_special_tokens=add_special)["input_ids"]
        mismatches = [(text, a, b) for text, a, b in zip(corpus, ours, theirs) if a != b]
        assert not mismatches, f"{name}: {len(mismatches)} of {len(corpus)} differ, first {mismatches[:3]}"
        # vLLM tokenizes one prompt at a time: single calls agree with the batch.
        for text in corpus[:200]:
            assert tok.encode(text, add_special) == hf(text, add_special_tokens=add_special)["input_ids"]


def test_special_tokens_and_vocab_equal_transformers(variant) -> None:
    name, _, hf, tok = variant
    assert tok.eos_token_id == hf.eos_token_id, name
    assert tok.bos_token_id == hf.bos_token_id, name
    assert tok.pad_token_id == hf.pad_token_id, name
    assert list(tok.all_special_tokens) == list(hf.all_special_tokens), name
    assert list(tok.all_special_ids) == list(hf.all_special_ids), name
    assert len(tok) == len(hf), name
    assert tok.max_token_id == hf.max_token_id, name
    assert tok.backend.get_vocab(with_added_tokens=True) == hf.get_vocab(), name
    ours = {i: (t.content, t.special, t.normalized, t.lstrip, t.rstrip, t.single_word) for i, t in tok.added_tokens.items()}
    theirs = {i: (t.content, t.special, t.normalized, t.lstrip, t.rstrip, t.single_word) for i, t in hf.added_tokens_decoder.items()}
    assert ours == theirs, name


def test_decode_equals_transformers(variant) -> None:
    name, _, hf, tok = variant
    rng = random.Random(3)
    ids = sorted(hf.get_vocab().values())
    corpus = _corpus_for(hf)
    for case in range(1000):
        if case % 2:
            seq = [rng.choice(ids) for _ in range(rng.randint(0, 30))]
        else:
            seq = hf(corpus[case], add_special_tokens=True)["input_ids"]
        for skip in (True, False):
            assert tok.decode(seq, skip_special_tokens=skip) == hf.decode(seq, skip_special_tokens=skip), (name, seq)


def test_incremental_detokenizer_equals_vllm(variant) -> None:
    name, _, hf, tok = variant
    pool = tok.encode(" ".join(_corpus_for(hf)[:300]) + MULTIBYTE, add_special_tokens=False)
    special = sorted(tok.added_tokens)
    rng = random.Random(99)
    for case in range(300):
        prompt = random_ids(rng, tok, pool, special, rng.randint(0, 8))
        output = random_ids(rng, tok, pool, special, rng.randint(1, 40))
        params = dict(skip_special_tokens=rng.random() < 0.7, spaces_between_special_tokens=rng.random() < 0.5)
        ours = IncrementalDetokenizer(tok, prompt, **params)
        ref = vllm_detokenizer(hf, prompt, **params)
        for token_id in output:
            assert ours.decode_next(token_id) == ref.decode_next(token_id), (name, case, prompt, output, params)


def test_issue_example_request_00001(tmp_path: Path) -> None:
    """The issue's report: a Qwen2-VL dir whose tokenizer.json has a plain ByteLevel pre-tokenizer."""
    from tests.text.tokenizer_dirs import qwen2_vl_plain_bytelevel

    import tokenizers

    path = qwen2_vl_plain_bytelevel(tmp_path / "m")
    tok = Tokenizer.from_model_files(ModelFiles.load(path))
    digits = [tok.token_to_id(d) for d in "01"]
    assert tok.encode("Request 00001", add_special_tokens=False)[-5:] == [digits[0]] * 4 + [digits[1]]
    # What following tokenizer.json would give (the bug): merged digits.
    as_file = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")).encode("Request 00001").ids
    assert as_file[-3:] == [tok.token_to_id("00"), tok.token_to_id("00"), digits[1]]


@pytest.mark.parametrize(("model_type", "tokenizer_class", "loaded_by_transformers"), REFUSED)
def test_unreproducible_classes_are_refused(tmp_path: Path, model_type, tokenizer_class, loaded_by_transformers) -> None:
    path = qwen2_vl_agree(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = model_type
    (path / "config.json").write_text(json.dumps(cfg))
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    tok_cfg["tokenizer_class"] = tokenizer_class
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    with pytest.raises(UnsupportedTokenizerError, match="cannot reproduce"):
        ModelFiles.load(path)
    if loaded_by_transformers is not None:
        from transformers import AutoTokenizer

        assert type(AutoTokenizer.from_pretrained(str(path))).__name__ == loaded_by_transformers


def test_remote_code_tokenizer_is_refused(tmp_path: Path) -> None:
    path = qwen2_vl_agree(tmp_path / "m")
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    tok_cfg["auto_map"] = {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    with pytest.raises(UnsupportedTokenizerError, match="remote code"):
        ModelFiles.load(path)


# The resolution table against AutoTokenizer on a grid of declared classes and model types.
GRID_MODEL_TYPES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2", "llava"]
GRID_CLASSES = [None, "Qwen2Tokenizer", "Qwen2TokenizerFast", "PreTrainedTokenizerFast", "TokenizersBackend", "LlamaTokenizerFast"]


@pytest.mark.parametrize("model_type", GRID_MODEL_TYPES)
def test_class_resolution_grid_equals_auto_tokenizer(tmp_path: Path, model_type: str) -> None:
    from transformers import AutoTokenizer

    if model_type == "llava":
        path = llava_agree(tmp_path / "m")
    else:
        path = qwen2_vl_agree(tmp_path / "m")
        cfg = json.loads((path / "config.json").read_text())
        cfg["model_type"] = model_type
        (path / "config.json").write_text(json.dumps(cfg))
    for declared in GRID_CLASSES:
        tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
        tok_cfg.pop("tokenizer_class", None)
        if declared is not None:
            tok_cfg["tokenizer_class"] = declared
        (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
        theirs = type(AutoTokenizer.from_pretrained(str(path))).__name__
        try:
            ours = resolve_tokenizer_class(model_type, declared).value
        except UnsupportedTokenizerError:
            ours = None
        if ours is None:
            assert theirs not in {c.value for c in TokenizerClass}, (model_type, declared, theirs)
        else:
            assert ours == theirs, (model_type, declared)

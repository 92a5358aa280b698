"""Tokenizer directories for the tokenizer-class tests: for each tokenizer class of the families we
serve, files whose tokenizer.json agrees with the class and files that do not.

Qwen family (transformers' Qwen2Tokenizer rebuilds the pipeline from its own definition): the
built-in Qwen2-VL files, and variants whose tokenizer.json has another normaliser / pre-tokenizer,
added tokens at ids that do not follow the vocabulary, tokenizer_config.json without eos/unk/pad
(class defaults), extra non-special added tokens with lstrip/rstrip/normalized flags, no
added_tokens_decoder (old layout), split_special_tokens, truncation/padding in tokenizer.json,
add_prefix_space; under model types qwen2_vl, qwen2_5_vl and qwen3_vl. LLaVA family (tokenizer.json
as is): the tiny LLaVA files, and variants with another declared class and another pipeline.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from tests.support.tiny_models import BUILTIN_MODEL_DIR, llava_model_files

PLAIN_BYTELEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")


def _edit(dest: Path, name: str, change: Callable[[dict], None]) -> None:
    data = _read(dest / name)
    change(data)
    _write(dest / name, data)


# Multi-digit and space+digit merges, as real Qwen vocabularies have: without them a pipeline that
# does not split digits would still give single-digit tokens, and the variants would not differ.
NUMBER_MERGES = [
    ("0", "0"), ("00", "0"), ("000", "1"), ("0", "1"), ("Ġ", "0"), ("Ġ0", "0"), ("Ġ00", "0"), ("1", "2"),
    ("12", "3"), ("Ġ", "1"), ("2", "0"), ("20", "2"), ("202", "4"), ("9", "9"), ("1", "0"), ("Ġ1", "0"),
]  # fmt: skip


def _with_number_merges(tok: dict) -> None:
    """Replace the last merges of the vocabulary (their tokens have the highest base ids and take part
    in no other merge) by NUMBER_MERGES, keeping the vocabulary size and the added tokens' ids."""
    model = tok["model"]
    vocab: dict[str, int] = model["vocab"]
    k = len(NUMBER_MERGES)
    dropped = ["".join(m) if isinstance(m, list) else m.replace(" ", "") for m in model["merges"][-k:]]
    free_ids = sorted(vocab.pop(t) for t in dropped)
    assert free_ids == list(range(len(vocab), len(vocab) + k)), "last merges do not own the last ids"
    for (a, b), token_id in zip(NUMBER_MERGES, free_ids):
        vocab[a + b] = token_id
    model["merges"] = model["merges"][:-k] + [[a, b] for a, b in NUMBER_MERGES]


def _copy_qwen(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for f in BUILTIN_MODEL_DIR.iterdir():
        if f.is_file():
            shutil.copyfile(f, dest / f.name)
    _edit(dest, "tokenizer.json", _with_number_merges)
    return dest


def _set_model_type(dest: Path, model_type: str, architecture: str) -> None:
    def change(cfg: dict) -> None:
        cfg["model_type"] = model_type
        cfg["architectures"] = [architecture]

    _edit(dest, "config.json", change)


def _add_extra_tokens(dest: Path, tokens: list[tuple[int, dict]], in_tokenizer_json: bool) -> None:
    """Add tokens at the given ids to tokenizer_config.json's added_tokens_decoder (and tokenizer.json)."""
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}

    def config(cfg: dict) -> None:
        for token_id, spec in tokens:
            cfg["added_tokens_decoder"][str(token_id)] = {**flags, **spec}

    def tokenizer(tok: dict) -> None:
        for token_id, spec in tokens:
            tok["added_tokens"].append({"id": token_id, **flags, **spec})

    _edit(dest, "tokenizer_config.json", config)
    if in_tokenizer_json:
        _edit(dest, "tokenizer.json", tokenizer)


def qwen2_vl_agree(dest: Path) -> Path:
    """The built-in model's files: tokenizer.json is exactly what Qwen2Tokenizer builds."""
    return _copy_qwen(dest)


def qwen2_vl_plain_bytelevel(dest: Path) -> Path:
    """The issue's case: a plain ByteLevel pre-tokenizer (no digit splitting), no normaliser."""
    _copy_qwen(dest)

    def change(tok: dict) -> None:
        tok["pre_tokenizer"] = PLAIN_BYTELEVEL
        tok["normalizer"] = None

    _edit(dest, "tokenizer.json", change)
    return dest


def qwen2_5_vl_odd_pipeline(dest: Path) -> Path:
    """Qwen2.5-VL, tokenizer_class Qwen2Tokenizer: tokenizer.json lowercases (NFKC + Lowercase), splits on
    whitespace (Metaspace), has a post-processor adding <|im_start|>, truncation and padding, and
    ignore_merges; added tokens at ids that leave gaps after the vocabulary, one of them non-special."""
    _copy_qwen(dest)
    _set_model_type(dest, "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration")

    def change(tok: dict) -> None:
        tok["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]}
        tok["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
        tok["model"]["ignore_merges"] = True
        tok["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1987], "tokens": ["<|im_start|>"]}},
        }
        tok["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
        tok["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                          "pad_id": 1986, "pad_type_id": 0, "pad_token": "<|endoftext|>"}  # fmt: skip

    _edit(dest, "tokenizer.json", change)
    _add_extra_tokens(
        dest,
        [
            (2010, {"content": "<tool_call>", "special": False}),
            (2011, {"content": "</tool_call>", "special": False}),
            (2050, {"content": "<|gap|>"}),
        ],
        in_tokenizer_json=True,
    )
    return dest


def qwen3_vl_class_defaults(dest: Path) -> Path:
    """Qwen3-VL, tokenizer_class Qwen2TokenizerFast: tokenizer_config.json without eos/unk/pad keys (the
    class defaults apply), non-special added tokens with lstrip/rstrip/normalized flags that only
    tokenizer_config.json knows, add_prefix_space true, tokenizer.json without a post-processor."""
    _copy_qwen(dest)
    _set_model_type(dest, "qwen3_vl", "Qwen3VLForConditionalGeneration")

    def config(cfg: dict) -> None:
        for key in ("eos_token", "unk_token", "pad_token", "bos_token"):
            cfg.pop(key, None)
        cfg["add_prefix_space"] = True

    _edit(dest, "tokenizer_config.json", config)
    _edit(dest, "tokenizer.json", lambda tok: tok.update(post_processor=None, pre_tokenizer=PLAIN_BYTELEVEL))
    _add_extra_tokens(
        dest,
        [
            (2000, {"content": "<think>", "special": False, "normalized": True}),
            (2001, {"content": "</think>", "special": False, "rstrip": True}),
            (2002, {"content": "[ADD]", "special": False, "lstrip": True, "single_word": True}),
        ],
        in_tokenizer_json=False,
    )
    return dest


def qwen2_vl_legacy_added_tokens(dest: Path) -> Path:
    """No added_tokens_decoder in tokenizer_config.json: transformers reads tokenizer.json's added tokens."""
    _copy_qwen(dest)
    _edit(dest, "tokenizer_config.json", lambda cfg: cfg.pop("added_tokens_decoder"))
    _edit(dest, "tokenizer.json", lambda tok: tok.update(pre_tokenizer=PLAIN_BYTELEVEL))
    return dest


def qwen2_vl_split_special(dest: Path) -> Path:
    """split_special_tokens: special tokens in text are tokenized as text."""
    _copy_qwen(dest)
    _edit(dest, "tokenizer_config.json", lambda cfg: cfg.update(split_special_tokens=True))
    return dest


def qwen2_vl_declared_generic(dest: Path) -> Path:
    """A Qwen2-VL model whose tokenizer_config.json declares PreTrainedTokenizerFast: transformers then
    uses tokenizer.json as is (here with a plain ByteLevel pre-tokenizer)."""
    qwen2_vl_plain_bytelevel(dest)
    _edit(dest, "tokenizer_config.json", lambda cfg: cfg.update(tokenizer_class="PreTrainedTokenizerFast"))
    return dest


def _write_llava(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name, content in llava_model_files().items():
        text = content if isinstance(content, str) else json.dumps(content, indent=2, sort_keys=True) + "\n"
        (dest / name).write_text(text, encoding="utf-8")
    return dest


def llava_agree(dest: Path) -> Path:
    """The tiny LLaVA-1.5 files (tokenizer_class LlamaTokenizer, model_type llava)."""
    return _write_llava(dest)


def llava_other_pipeline(dest: Path) -> Path:
    """LLaVA declaring LlamaTokenizerFast with a tokenizer.json unlike Llama's (NFKC, a Split pre-tokenizer on
    digits, no post-processor) and an extra added token: model_type llava forces TokenizersBackend, which
    uses tokenizer.json as is."""
    _write_llava(dest)

    def change(tok: dict) -> None:
        tok["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFKC"}, *tok["normalizer"]["normalizers"]]}
        tok["pre_tokenizer"] = {"type": "Digits", "individual_digits": True}
        tok["post_processor"] = None

    _edit(dest, "tokenizer.json", change)
    _edit(dest, "tokenizer_config.json", lambda cfg: cfg.update(tokenizer_class="LlamaTokenizerFast"))
    return dest


def llava_declared_generic(dest: Path) -> Path:
    """LLaVA declaring PreTrainedTokenizerFast, with non-special added tokens only the config lists."""
    _write_llava(dest)
    _edit(dest, "tokenizer_config.json", lambda cfg: cfg.update(tokenizer_class="PreTrainedTokenizerFast"))
    flags = {"lstrip": False, "normalized": True, "rstrip": False, "single_word": False, "special": False}

    def change(cfg: dict) -> None:
        cfg["added_tokens_decoder"]["1502"] = {**flags, "content": "<tool>"}
        cfg["added_tokens_decoder"]["1503"] = {**flags, "content": " spaced", "lstrip": True}

    _edit(dest, "tokenizer_config.json", change)
    return dest


VARIANTS: dict[str, Callable[[Path], Path]] = {
    "qwen2_vl-agree": qwen2_vl_agree,
    "qwen2_vl-plain-bytelevel": qwen2_vl_plain_bytelevel,
    "qwen2_5_vl-odd-pipeline": qwen2_5_vl_odd_pipeline,
    "qwen3_vl-class-defaults": qwen3_vl_class_defaults,
    "qwen2_vl-legacy-added-tokens": qwen2_vl_legacy_added_tokens,
    "qwen2_vl-split-special": qwen2_vl_split_special,
    "qwen2_vl-declared-generic": qwen2_vl_declared_generic,
    "llava-agree": llava_agree,
    "llava-other-pipeline": llava_other_pipeline,
    "llava-declared-generic": llava_declared_generic,
}


# (model_type, tokenizer_class) pairs mmserve must refuse, and the class transformers would load.
REFUSED: list[tuple[str, str | None, str]] = [
    ("llama", "LlamaTokenizer", "LlamaTokenizer"),
    ("qwen2_vl", "GPT2Tokenizer", "GPT2Tokenizer"),
    ("mistral", "PreTrainedTokenizerFast", "TokenizersBackend"),  # model type unknown to mmserve
]

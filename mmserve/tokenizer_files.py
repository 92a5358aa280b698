"""tokenizer_config.json, typed, and the transformers tokenizer class vLLM 0.32 ends up with.

vLLM tokenizes through ``transformers.AutoTokenizer`` (transformers 5.x). In transformers 5 the
class matters for the token ids, not just for naming: a class with its own ``__init__`` (such as
``Qwen2Tokenizer``) rebuilds the tokenizer from its hard-coded definition and keeps only the
vocabulary, merges and post-processor of ``tokenizer.json``; the generic ``TokenizersBackend``
(alias ``PreTrainedTokenizerFast``) uses ``tokenizer.json`` as is. So we resolve the class exactly
as ``AutoTokenizer.from_pretrained`` does (transformers 5.19, ``models/auto/tokenization_auto.py``)
for the model types we know, and refuse, at start-up, everything whose class we do not reproduce.
The class's keyword defaults for special tokens apply to tokenizer_config.json (they reach chat
templates too). ``mmserve/text/tokenizer.py`` builds the pipeline.

The tables below are the relevant rows of transformers' ``TOKENIZER_MAPPING_NAMES`` and
``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``; ``tests/text/test_tokenizer_classes.py`` checks our
resolution against ``AutoTokenizer`` itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

class UnsupportedTokenizerError(ValueError):
    """The model directory needs a tokenizer class whose behaviour mmserve does not reproduce."""


class TokenizerClass(enum.Enum):
    # tokenizer.json as is (transformers' TokenizersBackend / PreTrainedTokenizerFast).
    TOKENIZERS_BACKEND = "TokenizersBackend"
    # transformers' Qwen2Tokenizer: NFC + its own digit-splitting pre-tokenizer + ByteLevel.
    QWEN2 = "Qwen2Tokenizer"


# config.json model_type -> the class transformers registers for it (None: the type is known to
# transformers but has no tokenizer class of its own, e.g. "llama" in transformers 5.19).
_REGISTERED: dict[str, str | None] = {
    "qwen2": "Qwen2Tokenizer",
    "qwen2_moe": "Qwen2Tokenizer",
    "qwen2_vl": "Qwen2Tokenizer",
    "qwen2_5_vl": "Qwen2Tokenizer",
    "qwen3": "Qwen2Tokenizer",
    "qwen3_moe": "Qwen2Tokenizer",
    "qwen3_vl": "Qwen2Tokenizer",
    "qwen3_vl_moe": "Qwen2Tokenizer",
    # In MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS without a class: forced to TokenizersBackend.
    "llava": "TokenizersBackend",
    "llava_next": "TokenizersBackend",
    "llama": None,
}
# Model types whose hub tokenizer_class transformers overrides with the registered class.
_INCORRECT_HUB_CLASS: frozenset[str] = frozenset({"llava", "llava_next", "qwen2"})
_GENERIC: frozenset[str] = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast", "PythonBackend"})


def _class_from_name(name: str) -> TokenizerClass | None:
    """transformers' ``tokenizer_class_from_name`` for the names we reproduce ("Fast" suffixes are
    aliases in transformers 5); None for any other class."""
    if name in _GENERIC or name == "PreTrainedTokenizer":
        return TokenizerClass.TOKENIZERS_BACKEND
    if name.removesuffix("Fast") == "Qwen2Tokenizer":
        return TokenizerClass.QWEN2
    return None


def _refuse(what: str) -> UnsupportedTokenizerError:
    return UnsupportedTokenizerError(
        f"{what}: mmserve cannot reproduce the tokenizer vLLM would load for this model, so prompt token ids "
        "could differ silently. Supported: Qwen2Tokenizer (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen2/3) and "
        "tokenizer.json as is (TokenizersBackend / PreTrainedTokenizerFast, LLaVA)."
    )


def resolve_tokenizer_class(
    model_type: str | None,
    hub_class: str | None,
    *,
    has_auto_map: bool = False,
) -> TokenizerClass:
    """The class ``AutoTokenizer.from_pretrained`` instantiates.

    ``hub_class`` is tokenizer_config.json's ``tokenizer_class`` (or config.json's, when the former has
    none); ``has_auto_map``: tokenizer_config.json names remote code for AutoTokenizer.
    """
    if has_auto_map and model_type not in _INCORRECT_HUB_CLASS:
        raise _refuse("tokenizer_config.json names a custom tokenizer class (auto_map, remote code)")
    if model_type not in _REGISTERED:
        raise _refuse(f"model_type {model_type!r} in config.json")
    registered = _REGISTERED[model_type]
    # With an auto_map (ignored for these model types without trust_remote_code, vLLM's default)
    # transformers skips the registered-class check and goes by the hub class.
    if not has_auto_map and hub_class is not None and registered is not None and registered.removesuffix("Fast") != hub_class.removesuffix("Fast"):
        if registered not in _GENERIC:
            name = registered if model_type in _INCORRECT_HUB_CLASS else hub_class
            cls = _class_from_name(name)
            if cls is None:
                raise _refuse(f"tokenizer class {name!r} (model_type {model_type!r})")
            return cls
        return TokenizerClass.TOKENIZERS_BACKEND
    name = hub_class if hub_class is not None else registered
    if name is None:
        return TokenizerClass.TOKENIZERS_BACKEND
    cls = _class_from_name(name)
    if cls is None:
        raise _refuse(f"tokenizer class {name!r} (model_type {model_type!r})")
    return cls


# Named special tokens a class's __init__ defaults to when tokenizer_config.json has no such key
# (an explicit null keeps the token unset). Qwen2Tokenizer.__init__'s keyword defaults.
CLASS_DEFAULT_SPECIAL_TOKENS: dict[TokenizerClass, tuple[tuple[str, str], ...]] = {
    TokenizerClass.TOKENIZERS_BACKEND: (),
    TokenizerClass.QWEN2: (
        ("unk_token", "<|endoftext|>"),
        ("eos_token", "<|endoftext|>"),
        ("pad_token", "<|endoftext|>"),
    ),
}

# Qwen2Tokenizer's pre-tokenizer regex (transformers models/qwen2/tokenization_qwen2.py).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES, in order: the
# order matters because it is the order of `all_special_tokens`/`all_special_ids`.
STANDARD_SPECIAL_TOKEN_NAMES: tuple[str, ...] = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

@dataclass(frozen=True, slots=True)
class AddedTokenSpec:
    """A serialized ``AddedToken``: an entry of tokenizer_config.json's ``added_tokens_decoder`` (or,
    in old directories without one, of tokenizer.json's ``added_tokens``), or a special token given
    in its dict form (``{"__type": "AddedToken", ...}``; ``id`` None)."""

    id: int | None
    content: str
    special: bool
    single_word: bool = False
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = True

    @classmethod
    def from_json(cls, token_id: int | None, spec: dict[str, Any]) -> "AddedTokenSpec":
        special = bool(spec.get("special", False))
        return cls(
            id=token_id,
            content=spec["content"],
            special=special,
            single_word=bool(spec.get("single_word", False)),
            lstrip=bool(spec.get("lstrip", False)),
            rstrip=bool(spec.get("rstrip", False)),
            # tokenizers.AddedToken's default: special tokens are not normalized.
            normalized=bool(spec.get("normalized", not special)),
        )


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    """The parts of tokenizer_config.json the gateway relies on."""

    # Named special tokens in transformers order: the 7 standard names first,
    # then model-specific ``*_token`` keys (e.g. ``image_token``). These are
    # exactly the variables transformers passes to chat templates.
    named_special_tokens: tuple[tuple[str, str], ...] = ()
    # ``extra_special_tokens`` / legacy ``additional_special_tokens`` (list form).
    extra_special_tokens: tuple[str, ...] = ()
    added_tokens: tuple[AddedTokenSpec, ...] = ()
    chat_template: str | None = None
    named_chat_templates: tuple[tuple[str, str], ...] = ()
    clean_up_tokenization_spaces: bool = False
    # transformers 5 skips the clean-up for BPE models unless this is set too.
    clean_up_tokenization_spaces_for_bpe: bool = False
    tokenizer_class: str | None = None  # as written (the class actually used: ModelFiles.tokenizer_class)
    # False in old directories: transformers then takes the added tokens from tokenizer.json.
    has_added_tokens_decoder: bool = False
    # Flags of special tokens given in dict form (named or extra), by content.
    special_token_specs: tuple[AddedTokenSpec, ...] = ()
    add_prefix_space: bool | None = None
    split_special_tokens: bool = False
    has_auto_map: bool = False


def _token_content(value: Any) -> str | None:
    """Special tokens are stored either as plain strings or as serialized
    AddedToken dicts ({"content": ..., "__type": "AddedToken"})."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def has_tokenizer_auto_map(raw: dict[str, Any]) -> bool:
    auto_map = raw.get("auto_map")
    if isinstance(auto_map, (list, tuple)):
        return True
    return isinstance(auto_map, dict) and auto_map.get("AutoTokenizer") is not None


def _token_spec(value: Any) -> AddedTokenSpec | None:
    """The flags of a special token serialized as an AddedToken (transformers converts only dicts
    tagged ``"__type": "AddedToken"``)."""
    if isinstance(value, dict) and value.get("__type") == "AddedToken" and isinstance(value.get("content"), str):
        return AddedTokenSpec.from_json(None, {k: v for k, v in value.items() if k != "__type"})
    return None


def parse_tokenizer_config(
    raw: dict[str, Any], class_defaults: tuple[tuple[str, str], ...] = ()
) -> TokenizerConfig:
    named: dict[str, str] = {}
    defaults = dict(class_defaults)
    for name in STANDARD_SPECIAL_TOKEN_NAMES:
        # A key absent from the file takes the class's default; an explicit null unsets the token.
        value = raw[name] if name in raw else defaults.get(name)
        if (content := _token_content(value)) is not None:
            named[name] = content
    # transformers v5 turns any other ``*_token`` string key, and the dict form of
    # extra_special_tokens, into named special tokens (model-specific tokens).
    for key, value in raw.items():
        if key not in named and key.endswith("_token") and key not in STANDARD_SPECIAL_TOKEN_NAMES:
            if (content := _token_content(value)) is not None:
                named[key] = content
    extra_raw = raw.get("extra_special_tokens") or raw.get("additional_special_tokens") or []
    extra: list[str] = []
    if isinstance(extra_raw, dict):
        for key, value in extra_raw.items():
            if (content := _token_content(value)) is not None:
                named[key] = content
    else:
        extra = [c for v in extra_raw if (c := _token_content(v)) is not None]

    added = tuple(
        sorted(
            (
                AddedTokenSpec.from_json(int(token_id), spec)
                for token_id, spec in (raw.get("added_tokens_decoder") or {}).items()
            ),
            key=lambda t: t.id,
        )
    )
    specs = [spec for name in named if (spec := _token_spec(raw.get(name))) is not None]
    if isinstance(extra_raw, dict):
        specs += [spec for v in extra_raw.values() if (spec := _token_spec(v)) is not None]
    else:
        specs += [spec for v in extra_raw if (spec := _token_spec(v)) is not None]

    template = raw.get("chat_template")
    named_templates: tuple[tuple[str, str], ...] = ()
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named_templates = tuple((t["name"], t["template"]) for t in template)
        template = None
    return TokenizerConfig(
        named_special_tokens=tuple(named.items()),
        extra_special_tokens=tuple(extra),
        added_tokens=added,
        chat_template=template if isinstance(template, str) else None,
        named_chat_templates=named_templates,
        clean_up_tokenization_spaces=bool(raw.get("clean_up_tokenization_spaces", False)),
        clean_up_tokenization_spaces_for_bpe=bool(
            raw.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        ),
        tokenizer_class=raw.get("tokenizer_class"),
        has_added_tokens_decoder="added_tokens_decoder" in raw,
        special_token_specs=tuple(specs),
        add_prefix_space=raw.get("add_prefix_space"),
        split_special_tokens=bool(raw.get("split_special_tokens", False)),
        has_auto_map=has_tokenizer_auto_map(raw),
    )

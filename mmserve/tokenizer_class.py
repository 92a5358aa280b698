"""Which transformers tokenizer class vLLM 0.32 ends up with for a model directory.

vLLM tokenizes through ``transformers.AutoTokenizer`` (transformers 5.x). In transformers 5 the
class matters for the token ids, not just for naming: a class with its own ``__init__`` (such as
``Qwen2Tokenizer``) rebuilds the tokenizer from its hard-coded definition and keeps only the
vocabulary, merges and post-processor of ``tokenizer.json``; the generic ``TokenizersBackend``
(alias ``PreTrainedTokenizerFast``) uses ``tokenizer.json`` as is. So we resolve the class exactly
as ``AutoTokenizer.from_pretrained`` does (transformers 5.19, ``models/auto/tokenization_auto.py``)
for the model types we know, and refuse, at start-up, everything whose class we do not reproduce.

The tables below are the relevant rows of transformers' ``TOKENIZER_MAPPING_NAMES`` and
``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``; ``tests/text/test_tokenizer_classes.py`` checks our
resolution against ``AutoTokenizer`` itself.
"""

from __future__ import annotations

import enum


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

"""The tokenizer vLLM 0.32 loads, reproduced with the ``tokenizers`` library alone.

vLLM tokenizes through ``transformers.AutoTokenizer`` (transformers 5) and streams text through the
same Rust object (``tokenizer._tokenizer``), so building an identical ``tokenizers.Tokenizer`` gives
identical ids and text. What transformers does on top of ``tokenizer.json``, reproduced here:

* the class (``mmserve/tokenizer_files.py``): ``Qwen2Tokenizer`` rebuilds the pipeline from its own
  definition (NFC, a regex split with single digits, ByteLevel; BPE without unk/byte fallback) and
  keeps only tokenizer.json's vocabulary, merges and post-processor, so tokenizer.json's
  normalizer and pre-tokenizer are ignored and its added tokens are dropped. The generic
  ``TokenizersBackend`` (LLaVA) uses tokenizer.json as is;
* added tokens: every ``added_tokens_decoder`` entry of tokenizer_config.json (tokenizer.json's
  ``added_tokens`` in old directories without one) is added again in id order, then the named and
  extra special tokens not yet known. Ids are assigned by ``tokenizers`` itself, so a token whose
  recorded id does not follow the vocabulary gets the id transformers gives it, not the recorded one;
* ``all_special_tokens``/``all_special_ids``, ``len(tokenizer)``/``max_token_id`` (vLLM's
  ``CachedTokenizer``), ``split_special_tokens``, and padding/truncation off (as ``encode`` sets them).
"""

from __future__ import annotations

import json

import tokenizers
import tokenizers.decoders
import tokenizers.models
import tokenizers.normalizers
import tokenizers.pre_tokenizers
import tokenizers.processors

from ..model_files import ModelFiles
from ..tokenizer_files import (
    QWEN2_PRETOKENIZE_REGEX,
    AddedTokenSpec,
    TokenizerClass,
    TokenizerConfig,
    UnsupportedTokenizerError,
)


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, config: TokenizerConfig) -> None:
        """``backend``: the pipeline as ``build_backend`` made it (added tokens included)."""
        self.backend = backend
        self.config = config
        self.added_tokens: dict[int, tokenizers.AddedToken] = backend.get_added_tokens_decoder()
        self.special_tokens: dict[str, str] = dict(config.named_special_tokens)
        self.all_special_tokens: tuple[str, ...] = _all_special_tokens(config)
        self.all_special_ids: tuple[int, ...] = tuple(
            token_id for tok in self.all_special_tokens if (token_id := backend.token_to_id(tok)) is not None
        )
        self.bos_token_id = self._named_id("bos_token")
        self.eos_token_id = self._named_id("eos_token")
        self.pad_token_id = self._named_id("pad_token")
        # len(tokenizer) in transformers: base vocab + added tokens.
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.max_token_id: int = max(max(backend.get_vocab(with_added_tokens=True).values()), self.vocab_size - 1)
        # transformers 5 skips clean_up_tokenization for BPE models (it would eat real spaces).
        self._clean_up = config.clean_up_tokenization_spaces and (
            type(backend.model) is not tokenizers.models.BPE or config.clean_up_tokenization_spaces_for_bpe
        )

    @classmethod
    def from_model_files(cls, files: ModelFiles) -> "Tokenizer":
        return cls(build_backend(files), files.tokenizer_config)

    def _named_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Chat prompts are encoded with add_special_tokens=False (the template
        already holds them); completion prompts with True (vLLM's default)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            text = clean_up_tokenization(text)
        return text

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (applied by ``decode`` when the
    tokenizer config asks for it; vLLM's streamed text never applies it)."""
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


def _all_special_tokens(config: TokenizerConfig) -> tuple[str, ...]:
    """Named special tokens (standard names first), then extra ones, de-duplicated in order."""
    return tuple(dict.fromkeys([*(v for _, v in config.named_special_tokens), *config.extra_special_tokens]))


def build_backend(files: ModelFiles) -> tokenizers.Tokenizer:
    """The ``tokenizers.Tokenizer`` inside the transformers tokenizer vLLM loads for ``files``."""
    text = files.tokenizer_json.read_text(encoding="utf-8")
    config = files.tokenizer_config
    if files.tokenizer_class is TokenizerClass.QWEN2:
        raw = json.loads(text)
        backend = _qwen2_backend(raw, config)
        backend_added: list[str] = []
    else:
        raw = None
        backend = tokenizers.Tokenizer.from_str(text)
        backend_added = [tok.content for _, tok in sorted(backend.get_added_tokens_decoder().items())]
    # AutoTokenizer enables tokenizer.json's truncation/padding, and encode() switches them off.
    backend.no_truncation()
    backend.no_padding()

    if config.has_added_tokens_decoder:
        recorded = list(config.added_tokens)
    else:  # old directories: tokenizer.json's added tokens (re-added in id order below)
        raw = raw if raw is not None else json.loads(text)
        recorded = [AddedTokenSpec.from_json(t["id"], t) for t in raw.get("added_tokens") or ()]
    _add_tokens_as_transformers(backend, backend_added, recorded, config)
    if files.tokenizer_class is TokenizerClass.QWEN2:
        # Qwen2Tokenizer.__init__'s last step.
        backend.add_tokens([tokenizers.AddedToken(t, special=True) for t in _all_special_tokens(config)])
    backend.encode_special_tokens = config.split_special_tokens
    return backend


def _qwen2_backend(raw: dict, config: TokenizerConfig) -> tokenizers.Tokenizer:
    """``Qwen2Tokenizer.__init__`` with the vocabulary and merges transformers extracts from
    tokenizer.json (``TokenizersBackend.convert_to_native_format``) and its post-processor."""
    model = raw.get("model") or {}
    if model.get("type") != "BPE":
        raise UnsupportedTokenizerError(
            f"Qwen2Tokenizer needs a BPE tokenizer.json, this one is {model.get('type')!r}"
        )
    vocab = model.get("vocab") or {}
    if isinstance(vocab, list):
        vocab = {(tok[0] if isinstance(tok, list) else tok): i for i, tok in enumerate(vocab)}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges") or ()]
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.normalizer = tokenizers.normalizers.NFC()
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [
            tokenizers.pre_tokenizers.Split(
                tokenizers.Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False
            ),
            tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=bool(config.add_prefix_space), use_regex=False),
        ]
    )
    # The post-processor as transformers reads it: from tokenizer.json without vocabulary and added
    # tokens; when there is none, an equivalent no-op template (no BOS/EOS: add_bos_token is dropped
    # whenever tokenizer.json exists).
    minimal = dict(raw, model=dict(model, vocab={}, merges=[]), added_tokens=[])
    post = tokenizers.Tokenizer.from_str(json.dumps(minimal)).post_processor
    backend.post_processor = post if post is not None else tokenizers.processors.TemplateProcessing(
        single="$A:0", pair="$A:0 $B:1", special_tokens=[]
    )
    return backend


def _to_added_token(spec: AddedTokenSpec) -> tokenizers.AddedToken:
    return tokenizers.AddedToken(
        spec.content,
        single_word=spec.single_word,
        lstrip=spec.lstrip,
        rstrip=spec.rstrip,
        normalized=spec.normalized,
        special=spec.special,
    )


def _add_tokens_as_transformers(
    backend: tokenizers.Tokenizer,
    backend_added: list[str],
    recorded: list[AddedTokenSpec],
    config: TokenizerConfig,
) -> None:
    """``TokenizersBackend.__init__``: re-add every recorded added token (in id order), then the
    named and extra special tokens the backend does not know yet, in one ``add_tokens`` call."""
    to_add = [_to_added_token(spec) for spec in sorted(recorded, key=lambda t: t.id or 0)]
    known = set(backend_added) | {t.content for t in to_add}
    # Special tokens given in dict form keep their flags (recorded ones are already known).
    flags = {spec.content: spec for spec in config.special_token_specs}
    named = {v for _, v in config.named_special_tokens}
    for content in [*(v for _, v in config.named_special_tokens), *config.extra_special_tokens]:
        if content in known:
            continue
        spec = flags.get(content)
        if spec is None:
            token = tokenizers.AddedToken(content, special=True)
        else:
            token = _to_added_token(spec)
            if not token.special and content in named:
                token.special = True
        to_add.append(token)
        known.add(content)
    if to_add:
        backend.add_tokens(to_add)

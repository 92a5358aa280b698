"""Fast tokenizer with the semantics of transformers' ``TokenizersBackend``
(what vLLM's ``get_tokenizer`` returns for models with a tokenizer.json).

We wrap ``tokenizers.Tokenizer`` directly: vLLM itself encodes and streams
through the same Rust object (``tokenizer._tokenizer``), so identical inputs
give identical ids and text. The transformers-specific pieces reproduced here:

* tokens listed in tokenizer_config.json (``added_tokens_decoder`` and named
  special tokens) that tokenizer.json lacks are added, as transformers does;
* ``all_special_tokens``/``all_special_ids`` = named special tokens (standard
  names first) + extra special tokens, de-duplicated in order;
* ``len(tokenizer)``/``max_token_id`` as vLLM's ``CachedTokenizer`` computes them.

Not reproduced: transformers classes with a custom ``__init__`` (e.g.
``Qwen2Tokenizer``) rebuild the normalizer/pre-tokenizer/decoder from
hard-coded values and only keep tokenizer.json's vocab, merges and
post-processor. For real checkpoints both agree; a hand-made tokenizer.json
whose pipeline differs from its declared ``tokenizer_class`` would not.
"""

from __future__ import annotations

from pathlib import Path

import tokenizers

from ..model_files import ModelFiles, TokenizerConfig


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, config: TokenizerConfig) -> None:
        self.backend = backend
        self.config = config
        _add_missing_tokens(backend, config)

        self.added_tokens: dict[int, tokenizers.AddedToken] = backend.get_added_tokens_decoder()
        self.special_tokens: dict[str, str] = dict(config.named_special_tokens)
        self.all_special_tokens: tuple[str, ...] = tuple(
            dict.fromkeys([*self.special_tokens.values(), *config.extra_special_tokens])
        )
        self.all_special_ids: tuple[int, ...] = tuple(
            token_id for tok in self.all_special_tokens if (token_id := backend.token_to_id(tok)) is not None
        )
        self.bos_token_id = self._named_id("bos_token")
        self.eos_token_id = self._named_id("eos_token")
        self.pad_token_id = self._named_id("pad_token")
        # len(tokenizer) in transformers: base vocab + added tokens.
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.max_token_id: int = max(max(backend.get_vocab(with_added_tokens=True).values()), self.vocab_size - 1)

    @classmethod
    def from_model_files(cls, files: ModelFiles) -> "Tokenizer":
        return cls(tokenizers.Tokenizer.from_file(str(files.tokenizer_json)), files.tokenizer_config)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        return cls.from_model_files(ModelFiles.load(path))

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
        if self.config.clean_up_tokenization_spaces:
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


def _add_missing_tokens(backend: tokenizers.Tokenizer, config: TokenizerConfig) -> None:
    """transformers adds tokens from tokenizer_config.json that tokenizer.json
    does not know yet: ``added_tokens_decoder`` entries (in id order), then the
    named and extra special tokens (as special tokens)."""
    known = {tok.content for tok in backend.get_added_tokens_decoder().values()}
    to_add: list[tokenizers.AddedToken] = []
    for spec in config.added_tokens:
        if spec.content not in known:
            to_add.append(
                tokenizers.AddedToken(
                    spec.content,
                    single_word=spec.single_word,
                    lstrip=spec.lstrip,
                    rstrip=spec.rstrip,
                    normalized=spec.normalized,
                    special=spec.special,
                )
            )
            known.add(spec.content)
    for content in [v for _, v in config.named_special_tokens] + list(config.extra_special_tokens):
        # Even when the string is a base-vocab entry: it becomes an (unsplittable,
        # skippable) special added token with the same id, exactly as in transformers.
        if content not in known:
            to_add.append(tokenizers.AddedToken(content, special=True, normalized=False))
            known.add(content)
    if to_add:
        backend.add_tokens(to_add)

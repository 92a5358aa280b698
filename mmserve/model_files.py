"""Typed view of a Hugging Face model directory's JSON files: the one place that reads them.

Everything the gateway (and the built-in engine) needs from a model dir is read here once,
at startup, so that the text, image and engine layers work with typed values, not raw JSON:

* ``tokenizer.json``: the `tokenizers` pipeline (loaded by ``tokenizer.py``).
* ``tokenizer_config.json``: parsed by ``tokenizer_files.py`` (special and added tokens, the
  tokenizer class vLLM would load) and, in old checkpoints, the chat template.
* ``chat_template.jinja`` / ``chat_templates/*.jinja`` / ``chat_template.json``
  / ``processor_config.json``: chat template sources (see ``_resolve_chat_template``
  for the priority, which mirrors vLLM + transformers).
* ``generation_config.json`` (or ``config.json`` as fallback): extra EOS ids and
  the model's default sampling parameters.
* ``config.json``: model type, special token ids such as ``image_token_id``, vocabulary
  size and the vision tower's patch and merge sizes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .tokenizer_files import (
    CLASS_DEFAULT_SPECIAL_TOKENS,
    TokenizerClass,
    TokenizerConfig,
    UnsupportedTokenizerError,
    has_tokenizer_auto_map,
    parse_tokenizer_config,
    resolve_tokenizer_class,
)

# Sampling parameters vLLM takes from generation_config.json as request defaults
# (ModelConfig.get_diff_sampling_param). HF's max_new_tokens becomes max_tokens.
_SAMPLING_DEFAULT_KEYS: tuple[str, ...] = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """Non-null sampling values from generation_config.json (vLLM applies them
    as request defaults unless started with ``--generation-config vllm``)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    # All EOS ids from generation_config.json (int or list in the file). vLLM adds
    # those that differ from the tokenizer's EOS to the request's stop_token_ids.
    eos_token_ids: tuple[int, ...] = ()
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The few config.json values the text, image and engine layers look at."""

    model_type: str | None = None
    architectures: tuple[str, ...] = ()
    # Every integer ``*_token_id`` / ``*_token_index`` from config.json and its
    # text_config (top level wins), e.g. image_token_id, vision_start_token_id.
    token_ids: tuple[tuple[str, int], ...] = ()
    max_position_embeddings: int | None = None
    vocab_size: int | None = None
    # vision_config's patch_size and spatial_merge_size (None when absent).
    vision_patch_size: int | None = None
    vision_merge_size: int | None = None

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        """config.json alone (empty when the directory has none)."""
        return _parse_model_config(_read_json(Path(path) / "config.json") or {})

    def token_id(self, name: str) -> int | None:
        for key, value in self.token_ids:
            if key == name:
                return value
        return None


@dataclass(frozen=True, slots=True)
class ChatTemplateSource:
    text: str
    origin: str  # file (or file:key) it came from, for logs and errors


@dataclass(frozen=True, slots=True)
class ModelFiles:
    path: Path
    tokenizer_json: Path
    tokenizer_config: TokenizerConfig
    generation_config: GenerationConfig
    model_config: ModelConfig
    chat_template: ChatTemplateSource | None
    # The transformers class vLLM's AutoTokenizer instantiates (tokenizer_files.py); refused at load
    # when we cannot reproduce it.
    tokenizer_class: TokenizerClass = TokenizerClass.TOKENIZERS_BACKEND
    # Named templates ("default", "tool_use", ...) when the dir defines several.
    named_chat_templates: tuple[tuple[str, str], ...] = ()

    @classmethod
    def load(cls, path: str | Path) -> "ModelFiles":
        root = Path(path)
        tokenizer_json = root / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise FileNotFoundError(f"{tokenizer_json} not found (only fast tokenizers are supported)")
        raw_config = _read_json(root / "config.json") or {}
        raw_tok_config = _read_json(root / "tokenizer_config.json") or {}
        tokenizer_class = resolve_tokenizer_class(
            raw_config.get("model_type"),
            raw_tok_config.get("tokenizer_class") or raw_config.get("tokenizer_class"),
            has_auto_map=has_tokenizer_auto_map(raw_tok_config),
        )
        tok_config = parse_tokenizer_config(raw_tok_config, CLASS_DEFAULT_SPECIAL_TOKENS[tokenizer_class])
        if not tok_config.has_added_tokens_decoder:
            legacy = [name for name in ("special_tokens_map.json", "added_tokens.json") if (root / name).is_file()]
            if legacy:
                raise UnsupportedTokenizerError(
                    f"{root}: tokenizer_config.json has no added_tokens_decoder and the legacy {', '.join(legacy)} "
                    "is present; re-save the tokenizer with a recent transformers"
                )
        chat_template, named = _resolve_chat_template(root, tok_config)
        return cls(
            path=root,
            tokenizer_json=tokenizer_json,
            tokenizer_config=tok_config,
            generation_config=_parse_generation_config(_read_json(root / "generation_config.json"), raw_config),
            model_config=_parse_model_config(raw_config),
            chat_template=chat_template,
            tokenizer_class=tokenizer_class,
            named_chat_templates=named,
        )


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _resolve_chat_template(
    root: Path, tok_config: TokenizerConfig
) -> tuple[ChatTemplateSource | None, tuple[tuple[str, str], ...]]:
    """Pick the chat template the way vLLM's ``resolve_chat_template`` does
    (without a request-supplied template, without tools):

    1. the AutoProcessor's template, when the model has a processor: its
       ``processor_config.json["chat_template"]``, else the legacy
       ``chat_template.json``, else ``chat_template.jinja``;
    2. the tokenizer's template: ``chat_template.jinja`` (plus
       ``chat_templates/*.jinja``) take priority over tokenizer_config.json's
       ``chat_template`` key, as in transformers.

    Named templates: a "default" entry is used, as transformers does without tools.
    vLLM's built-in fallback templates (for models shipping none) are not covered.
    """
    has_processor = any(
        (root / name).is_file()
        for name in ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
    )
    if has_processor:
        processor_cfg = _read_json(root / "processor_config.json") or {}
        if isinstance(processor_cfg.get("chat_template"), str):
            return ChatTemplateSource(processor_cfg["chat_template"], "processor_config.json:chat_template"), ()
        legacy = _read_json(root / "chat_template.json")
        if legacy is not None and isinstance(legacy.get("chat_template"), str):
            return ChatTemplateSource(legacy["chat_template"], "chat_template.json"), ()

    named: dict[str, str] = {}
    template_dir = root / "chat_templates"
    if template_dir.is_dir():
        for file in sorted(template_dir.glob("*.jinja")):
            named[file.stem] = file.read_text(encoding="utf-8")
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        named["default"] = jinja_file.read_text(encoding="utf-8")
    if named:
        origin = "chat_template.jinja" if jinja_file.is_file() else "chat_templates/default.jinja"
        default = named.get("default")
        return (ChatTemplateSource(default, origin) if default is not None else None), tuple(named.items())

    if tok_config.chat_template is not None:
        return ChatTemplateSource(tok_config.chat_template, "tokenizer_config.json:chat_template"), ()
    if tok_config.named_chat_templates:
        default = dict(tok_config.named_chat_templates).get("default")
        source = ChatTemplateSource(default, "tokenizer_config.json:chat_template[default]") if default else None
        return source, tok_config.named_chat_templates
    return None, ()


def _eos_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return ()


def _parse_generation_config(raw: dict[str, Any] | None, model_config: dict[str, Any]) -> GenerationConfig:
    if raw is None:
        # vLLM falls back to GenerationConfig.from_model_config(config.json),
        # which only carries token ids (eos) and no sampling defaults.
        text_config = model_config.get("text_config") or {}
        eos = model_config.get("eos_token_id")
        if eos is None:
            eos = text_config.get("eos_token_id")
        return GenerationConfig(eos_token_ids=_eos_ids(eos))

    values = {k: raw[k] for k in _SAMPLING_DEFAULT_KEYS if raw.get(k) is not None}
    if "max_new_tokens" in values:
        values["max_tokens"] = values.pop("max_new_tokens")
    return GenerationConfig(
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        sampling_defaults=SamplingDefaults(**values),
    )


def _parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    token_ids: dict[str, int] = {}
    for source in (raw, raw.get("text_config") or {}, raw.get("vision_config") or {}):
        for key, value in source.items():
            if (key.endswith("_token_id") or key.endswith("_token_index")) and isinstance(value, int):
                token_ids.setdefault(key, value)
    text_config = raw.get("text_config") or {}
    vision_config = raw.get("vision_config") or {}
    max_pos = raw.get("max_position_embeddings", text_config.get("max_position_embeddings"))
    return ModelConfig(
        model_type=raw.get("model_type"),
        architectures=tuple(raw.get("architectures") or ()),
        token_ids=tuple(token_ids.items()),
        max_position_embeddings=max_pos if isinstance(max_pos, int) else None,
        vocab_size=_int_or_none(raw.get("vocab_size")),
        vision_patch_size=_int_or_none(vision_config.get("patch_size")),
        vision_merge_size=_int_or_none(vision_config.get("spatial_merge_size")),
    )


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

"""Model directories for the text-layer tests.

* ``builtin``: mmserve/builtin_engine/model (Qwen2-VL layout), when present;
* ``qwen``: a byte-level BPE trained here on mixed-script text (so CJK/emoji
  characters are split across several byte tokens), Qwen2 pipeline and the
  Qwen2-VL chat template, tokenizer_class Qwen2Tokenizer;
* ``llama``: a SentencePiece-style BPE (Metaspace + byte fallback, BOS added
  by the post-processor), a "string"-format template using ``bos_token``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

BUILTIN_DIR = Path(__file__).resolve().parents[2] / "mmserve" / "builtin_engine" / "model"

QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: "
    "{% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)

LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}<<SYS>>{{ message['content'] | trim }}<</SYS>>\n"
    "{% elif message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% elif message['role'] == 'assistant' %} {{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('bad role ' + message['role']) }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '' }}{% endif %}"
)

QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello, world! How are you today?",
    "Streaming tokens: one, two, three... 1234567890 and more numbers 3.14159",
    "你好，世界！今天天气很好。我们一起去公园散步吧。机器学习和人工智能。",
    "こんにちは世界。日本語のテキストです。カタカナとひらがな。",
    "Emoji time 😀😃😄 🎉🎊 👍🏽 🚀✨ and flags 🇫🇷🇯🇵",
    "Ünïcödé àccents: café, naïve, résumé, Straße, Ελληνικά, русский текст",
    "def f(x):\n    return x * 2\n\n# code block\nprint(f(21))",
    "STOP here. END of story. ### Observation: done\n\nUser: next",
]


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")


def _added_tokens_decoder(tok: Tokenizer, specials: list[str]) -> dict[str, dict]:
    return {
        str(tok.token_to_id(s)): {
            "content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True,
        }
        for s in specials
    }  # fmt: skip


def build_qwen_dir(root: Path) -> Path:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(
                    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
                ),
                behavior="isolated",
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in QWEN_SPECIALS])
    tok.save(str(root / "tokenizer.json"))
    _write_json(
        root / "tokenizer_config.json",
        {
            "added_tokens_decoder": _added_tokens_decoder(tok, QWEN_SPECIALS),
            "additional_special_tokens": QWEN_SPECIALS[1:],
            "bos_token": None,
            "chat_template": QWEN2_VL_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "errors": "replace",
            "model_max_length": 4096,
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
        },
    )
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    _write_json(root / "generation_config.json", {"eos_token_id": eos, "temperature": 0.7, "top_k": 20})
    _write_json(
        root / "config.json",
        {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "eos_token_id": eos[0],
         "image_token_id": tok.token_to_id("<|image_pad|>")},
    )  # fmt: skip
    return root


def build_llama_dir(root: Path) -> Path:
    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials + byte_tokens, show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(root / "tokenizer.json"))
    _write_json(
        root / "tokenizer_config.json",
        {
            "added_tokens_decoder": _added_tokens_decoder(tok, specials),
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "chat_template": LLAMA_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    _write_json(root / "config.json", {"model_type": "llama", "eos_token_id": tok.token_to_id("</s>")})
    return root


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return list(CORPUS)


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen_dir(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama_dir(tmp_path_factory.mktemp("llama"))


def _model_dir_params() -> list[str]:
    return ["qwen", "llama"] + (["builtin"] if (BUILTIN_DIR / "tokenizer.json").is_file() else [])


@pytest.fixture(scope="session", params=_model_dir_params())
def model_dir(request: pytest.FixtureRequest) -> Path:
    if request.param == "builtin":
        return BUILTIN_DIR
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture(scope="session")
def hf_tokenizer_cache() -> dict:
    return {}


@pytest.fixture()
def hf_tokenizer(model_dir: Path, hf_tokenizer_cache: dict):
    """The transformers tokenizer vLLM would load for this dir."""
    if model_dir not in hf_tokenizer_cache:
        from transformers import AutoTokenizer

        hf_tokenizer_cache[model_dir] = AutoTokenizer.from_pretrained(str(model_dir))
    return hf_tokenizer_cache[model_dir]

#!/usr/bin/env python3
"""Write mmserve's built-in tiny Qwen2-VL model directory (configs + tokenizer, no weights).

Output: ``mmserve/builtin_engine/model/`` (or the directory given as the first argument).

Why: no model can be downloaded on the build/test machines, yet the gateway and the tests need a
real-looking Qwen2-VL model directory: a byte-level BPE tokenizer carrying the Qwen2-VL special
tokens, the real Qwen2-VL-Instruct chat template, a Qwen2-VL ``config.json`` for a tiny network, and
the Hugging Face image-processor configs. Weights are *not* written here (they are random and are
added by ``tests/support/tiny_models.py`` with transformers); everything written here is small and
committed.

The script is deterministic: the same bytes on every run (the BPE trainer is deterministic for a
fixed corpus, and every JSON file is written with sorted keys). It imports only ``tokenizers``
(a gateway dependency), never torch/transformers/vllm.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "mmserve" / "builtin_engine" / "model"

# --------------------------------------------------------------------------------------------------
# Tokenizer layout
# --------------------------------------------------------------------------------------------------
# Qwen2-VL's special tokens, in Qwen2-VL's own order (there they start at 151643; here they follow the
# BPE vocabulary). The trained BPE vocabulary must have exactly BPE_VOCAB_SIZE entries so that the
# special-token ids below are fixed; the script asserts it.
BPE_VOCAB_SIZE = 1986
SPECIAL_TOKENS = [
    "<|endoftext|>",  # 1986  pad, "bos" in config, second eos in generation_config
    "<|im_start|>",  # 1987
    "<|im_end|>",  # 1988  eos
    "<|object_ref_start|>",  # 1989
    "<|object_ref_end|>",  # 1990
    "<|box_start|>",  # 1991
    "<|box_end|>",  # 1992
    "<|quad_start|>",  # 1993
    "<|quad_end|>",  # 1994
    "<|vision_start|>",  # 1995
    "<|vision_end|>",  # 1996
    "<|vision_pad|>",  # 1997
    "<|image_pad|>",  # 1998
    "<|video_pad|>",  # 1999
]
TOKEN_ID = {tok: BPE_VOCAB_SIZE + i for i, tok in enumerate(SPECIAL_TOKENS)}
VOCAB_SIZE = BPE_VOCAB_SIZE + len(SPECIAL_TOKENS)  # 2000: the model's vocab covers every token id

# Qwen2's pre-tokenizer regex (transformers' Qwen2Tokenizer re-imposes exactly this pipeline when it
# loads tokenizer.json, so the file must use the same one for the `tokenizers` library and
# transformers to agree).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# The Qwen2-VL-Instruct chat template, verbatim (system default, string or list content, image /
# image_url / video parts, optional "Picture N: " labels, add_generation_prompt).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MODEL_MAX_LENGTH = 4096

# --------------------------------------------------------------------------------------------------
# Training corpus: embedded so the result never depends on files outside this script. English prose,
# chat-like lines, Python/JSON/shell code, numbers and some non-ASCII text (accents, CJK, emoji) so
# that the tokenizer has multi-byte merges and realistic incremental-detokenization edge cases.
# --------------------------------------------------------------------------------------------------
CORPUS = r'''
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words.
You are a helpful assistant. What is in this image? Describe the picture in one sentence.
The image shows a red square on a white background. There is a cat sitting on the sofa.
Please answer the question briefly. I can see two people walking along the beach at sunset.
The weather today is sunny with a light breeze from the west, and the temperature is about twenty degrees.
Once upon a time, in a small village near the mountains, there lived an old baker who made the best bread
in the whole country. Every morning he woke up before dawn, lit the oven, and kneaded the dough by hand.
Children would gather at his window to watch the loaves rise, and the smell of fresh bread filled the streets.
Machine learning models learn patterns from data. A language model predicts the next token given the
previous tokens. Vision language models combine an image encoder with a text decoder, so that they can
answer questions about pictures, read text in photos, and describe scenes.
The server receives a request, tokenizes the prompt, sends it to the engine, and streams the generated
tokens back to the client. Each request has a unique identifier, a list of prompt tokens, and sampling
parameters such as temperature, top p, top k, the maximum number of tokens, and stop sequences.
When the engine finishes a request, it reports the reason: the model emitted an end of sequence token,
a stop string matched, or the length limit was reached. Errors are reported with a clear message.
Users often ask: How many apples are on the table? What color is the car? Where was this photo taken?
Who is standing next to the tree? Why is the sky blue? When does the train leave? Which one is larger?
Yes. No. Maybe. I do not know. Thank you very much! You're welcome. It's a beautiful day, isn't it?
They've been working here since 2019; we'll see what happens next. She'd like a cup of tea, please.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 3.14159 2.71828 -1 +7 1e-5 50% $19.99
Dates and times: 2024-05-17 12:30:45, Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
Months: January, February, March, April, May, June, July, August, September, October, November, December.
Colors: red, orange, yellow, green, blue, indigo, violet, black, white, gray, brown, pink, purple.
Animals: cat, dog, horse, cow, sheep, bird, fish, lion, tiger, bear, elephant, giraffe, zebra, monkey.
Objects: table, chair, window, door, car, bicycle, phone, computer, book, pen, cup, bottle, lamp, clock.
The history of computing begins with mechanical calculators, continues with electronic machines built
during the war, and leads to personal computers, the internet, mobile phones, and cloud services.
Good software is simple, tested, and documented. Measure before you optimize. Fail loudly and early.
Read the specification carefully, write small functions, and keep the interfaces narrow and explicit.

def tokenize(text: str, add_special_tokens: bool = False) -> list[int]:
    """Return the token ids of text."""
    ids = []
    for piece in split(text):
        if piece in vocab:
            ids.append(vocab[piece])
        else:
            ids.extend(bpe(piece))
    return ids


class Request:
    def __init__(self, request_id, prompt_token_ids, sampling_params=None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params or {}
        self.output_token_ids = []

    def is_finished(self) -> bool:
        return len(self.output_token_ids) >= self.sampling_params.get("max_tokens", 16)


async def generate(engine, request):
    async for output in engine.stream(request):
        yield output.text
    await engine.close()


import json, os, sys
config = json.loads(open(os.path.join(sys.argv[1], "config.json")).read())
print(f"hidden size = {config['hidden_size']}, layers = {config['num_hidden_layers']}")
if __name__ == "__main__":
    main()

{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}], "max_tokens": 32, "temperature": 0.0, "stream": true}
curl -s http://localhost:8000/v1/chat/completions -H "Content-Type: application/json" -d @request.json
for i in range(10): x = x * 2 + 1  # comment
while True: break
try: pass
except Exception as exc: raise RuntimeError("failed") from exc
SELECT name, count(*) FROM users WHERE age > 21 GROUP BY name ORDER BY 2 DESC LIMIT 10;
<html><body><p>Hello, world!</p></body></html>
#include <stdio.h>
int main(void) { printf("hello\n"); return 0; }

Français : café, crème brûlée, naïve, déjà vu, où est la gare ? Ça va très bien, merci.
Deutsch: Größe, Straße, Übung, schön, Mädchen, Grüße aus München.
Español: niño, mañana, ¿Dónde está la biblioteca? ¡Hola! Canción, corazón, acción.
Português: não, coração, informação, São Paulo. Italiano: città, perché, più, caffè.
Русский: привет, мир, спасибо, хорошо, картинка, кошка, собака.
Ελληνικά: γεια σου κόσμε, ευχαριστώ. עברית: שלום עולם. العربية: مرحبا بالعالم.
中文：你好，世界。这张图片里有一只猫。请描述这张图片。今天天气很好。我们一起去公园吧。
日本語：こんにちは、世界。これは猫の写真です。ありがとうございます。東京は大きな都市です。
한국어: 안녕하세요, 세계. 이 사진에는 고양이가 있습니다. 감사합니다.
Emoji: 😀 😃 😄 😁 😆 😅 😂 🤣 🙂 🙃 😉 😊 😇 🐱 🐶 🌞 🌈 🍎 🍕 🚗 ✈️ 🎉 ❤️ 👍 👀 🔥 ✅ ❌
Symbols: © ® ™ ° ± × ÷ ≤ ≥ ≠ ≈ ∞ √ π Σ Ω µ € £ ¥ § ¶ • … — – “quoted” ‘single’ « guillemets » → ← ↑ ↓
Math: x² + y² = z², ∫ f(x) dx, ∂y/∂x, α β γ δ ε θ λ μ σ φ ψ ω, A ⊂ B, ∀x ∃y.
'''


def training_lines() -> list[str]:
    # Repeat the corpus a few times, each time with a different simple transformation, so frequent
    # words get merged first and capitalised / spaced variants exist too. Pure functions of CORPUS.
    lines = CORPUS.strip("\n").split("\n")
    out: list[str] = []
    out += lines
    out += [line.lower() for line in lines]
    out += [" " + line for line in lines]
    out += [line.upper() for line in lines if line.isascii()]
    return [line + "\n" for line in out]


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(
        models.BPE(
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        # All 256 byte symbols, so any input is encodable (byte-level BPE never needs <unk>).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(training_lines(), trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=False)
    if got != BPE_VOCAB_SIZE:
        raise SystemExit(f"BPE vocabulary has {got} entries, expected {BPE_VOCAB_SIZE}: extend CORPUS")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for t, i in TOKEN_ID.items():
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t), i)
    return tok


def tokenizer_config() -> dict:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(TOKEN_ID[t]): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
        "additional_special_tokens": [
            t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_end|>")
        ],
        "bos_token": None,
        "chat_template": QWEN2_VL_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "padding_side": "left",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2TokenizerFast",
        "unk_token": None,
    }


def model_config() -> dict:
    # The legacy flat layout of the published Qwen2-VL-*-Instruct checkpoints (text fields at the top
    # level, `rope_scaling` with the mRoPE sections): what vLLM and transformers both read for real
    # checkpoints. head_dim = hidden / heads = 64, and mrope_section must sum to head_dim / 2.
    hidden = 128
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "attention_dropout": 0.0,
        "bos_token_id": TOKEN_ID["<|endoftext|>"],
        "eos_token_id": TOKEN_ID["<|im_end|>"],
        "hidden_act": "silu",
        "hidden_size": hidden,
        "image_token_id": TOKEN_ID["<|image_pad|>"],
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "max_window_layers": 2,
        "model_type": "qwen2_vl",
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "num_key_value_heads": 1,
        "pad_token_id": TOKEN_ID["<|endoftext|>"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_section": [8, 12, 12], "rope_type": "default", "type": "mrope"},
        "rope_theta": 1000000.0,
        "sliding_window": MODEL_MAX_LENGTH,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "video_token_id": TOKEN_ID["<|video_pad|>"],
        "vision_config": {
            "depth": 2,
            "embed_dim": 64,
            "hidden_act": "quick_gelu",
            "hidden_size": hidden,  # the merger projects vision features to the text hidden size
            "in_channels": 3,
            "in_chans": 3,
            "mlp_ratio": 4,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
        },
        "vision_end_token_id": TOKEN_ID["<|vision_end|>"],
        "vision_start_token_id": TOKEN_ID["<|vision_start|>"],
        "vision_token_id": TOKEN_ID["<|vision_pad|>"],
        "vocab_size": VOCAB_SIZE,
    }


def generation_config() -> dict:
    # Like Qwen2-VL-Instruct's eos list, but *without* its sampling defaults (temperature 0.01, top_k 1,
    # ...): vLLM applies generation_config sampling defaults to OpenAI requests that omit them, and
    # tests are simpler when "unspecified" means vLLM's plain defaults.
    return {
        "bos_token_id": TOKEN_ID["<|endoftext|>"],
        "eos_token_id": [TOKEN_ID["<|im_end|>"], TOKEN_ID["<|endoftext|>"]],
        "pad_token_id": TOKEN_ID["<|endoftext|>"],
    }


CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
MIN_PIXELS = 3136  # 56*56: 4 patches -> 1 merged token
# 256 merged tokens (1024 patches of 14x14) at most per image: large images are downscaled, and an
# image always fits in a 1024-token context with room for text.
MAX_PIXELS = 256 * 28 * 28  # 200704


def preprocessor_config() -> dict:
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": CLIP_MEAN,
        "image_processor_type": "Qwen2VLImageProcessor",
        "image_std": CLIP_STD,
        "max_pixels": MAX_PIXELS,
        "merge_size": 2,
        "min_pixels": MIN_PIXELS,
        "patch_size": 14,
        "processor_class": "Qwen2VLProcessor",
        "resample": 3,  # bicubic
        "rescale_factor": 0.00392156862745098,
        "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
        "temporal_patch_size": 2,
    }


def video_preprocessor_config() -> dict:
    cfg = preprocessor_config()
    cfg.pop("image_processor_type")
    cfg["video_processor_type"] = "Qwen2VLVideoProcessor"
    return cfg


def dump_json(obj) -> str:
    # Sorted keys, fixed indent, trailing newline: byte-identical output run to run.
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    files = {
        # tokenizers' own serialisation orders the vocab by id and merges by rank (deterministic).
        "tokenizer.json": json.dumps(json.loads(tok.to_str()), indent=2, ensure_ascii=False) + "\n",
        "tokenizer_config.json": dump_json(tokenizer_config()),
        "chat_template.json": dump_json({"chat_template": QWEN2_VL_CHAT_TEMPLATE}),
        "config.json": dump_json(model_config()),
        "generation_config.json": dump_json(generation_config()),
        "preprocessor_config.json": dump_json(preprocessor_config()),
        "video_preprocessor_config.json": dump_json(video_preprocessor_config()),
    }
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    total = sum((out / n).stat().st_size for n in files)
    print(f"wrote {len(files)} files, {total} bytes, to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

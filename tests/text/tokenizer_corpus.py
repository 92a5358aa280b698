"""A generated corpus for tokenizer equality tests: the inputs where tokenizer pipelines differ.

Digits and number runs (single-digit splitting), mixed scripts (NFC/NFD forms, CJK, RTL, combining
marks), emoji (ZWJ sequences, skin tones, flags), whitespace and newline runs (tabs, CRLF, NBSP,
ideographic space), contractions, code, and the model's special and added tokens inside text (glued
to words, between spaces, repeated, partial). Deterministic for a seed.
"""

from __future__ import annotations

import random
import unicodedata

WORDS = [
    "Request", "hello", "world", "The", "quick", "brown", "fox", "café", "naïve", "Straße", "über",
    "don't", "I'm", "we'll", "they've", "it's", "HELLO", "MiXeD", "snake_case", "camelCase", "x",
    "你好", "世界", "机器学习", "こんにちは", "カタカナ", "한국어", "Ελληνικά", "русский", "עברית", "العربية",
    "हिन्दी", "ไทย", "Tiếng", "Việt",
]  # fmt: skip
NUMBERS = [
    "0", "7", "00001", "12345678901234567890", "3.14159", "-42", "1,000,000", "1e-9", "0x1F", "2024-05-17",
    "١٢٣", "٤٥", "१२३", "①②", "½", "Ⅻ", "10:30", "v1.2.3", "#1", "99%",
]  # fmt: skip
EMOJI = [
    "😀", "🎉", "👍🏽", "🇫🇷", "🇯🇵", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "✨", "🚀", "🤖", "🫠", "👩🏻‍💻", "©", "™",
]  # fmt: skip
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\n\n\n\n", "\u00a0", "\u3000", "\u2009", " \t\n", "\v", "\f"]
PUNCT = [".", ",", "!", "?", "...", "'", '"', "(", ")", "[", "]", "{", "}", "<", ">", "/", "\\", "-", "_", "=", "+", "*",
         "&", "|", ";", ":", "@", "$", "%", "^", "~", "`", "«", "»", "—", "…", "・", "、", "。"]  # fmt: skip
CODE = [
    "def f(x):\n    return x * 2\n",
    "if (a <= b && c != d) { return; }",
    "<div class=\"x\">hi</div>",
    "SELECT * FROM t WHERE id = 10;",
    "{\"key\": [1, 2, 3], \"ok\": true}",
]  # fmt: skip
# Decomposed (NFD) and compatibility forms: NFC normalisation changes these.
COMBINING = ["e\u0301", "a\u0308", "n\u0303", "A\u030a", "\u1100\u1161", "ﬁ", "Ⅸ", "ｆｕｌｌ", "K\u0323\u0307"]


def _piece(rng: random.Random, specials: list[str]) -> str:
    r = rng.random()
    if r < 0.22:
        return rng.choice(WORDS)
    if r < 0.40:
        return rng.choice(NUMBERS) if rng.random() < 0.6 else "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 12)))
    if r < 0.50:
        return rng.choice(EMOJI)
    if r < 0.66:
        return rng.choice(SPACES)
    if r < 0.76:
        return rng.choice(PUNCT)
    if r < 0.82:
        return rng.choice(COMBINING)
    if r < 0.85:
        return rng.choice(CODE)
    if r < 0.97 and specials:
        token = rng.choice(specials)
        if rng.random() < 0.1:  # a partial special token is plain text
            token = token[: rng.randint(1, max(1, len(token) - 1))]
        return token
    return chr(rng.choice([rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x2FFF), rng.randint(0x4E00, 0x9FFF), rng.randint(0x1F300, 0x1FAFF)]))


def generate_corpus(specials: list[str], n: int = 10_000, seed: int = 0) -> list[str]:
    """``n`` distinct strings; ``specials`` (the model's special and added tokens) appear inside text."""
    rng = random.Random(seed)
    fixed = [
        "",
        "Request 00001",
        "Request 00001 and 1234567 then 3.14",
        " leading space",
        "trailing space ",
        "\n\n\t tabs and\r\nnewlines",
        "   ",
        "\n",
        "".join(specials),
        " ".join(specials),
        unicodedata.normalize("NFD", "café naïve résumé"),
    ]
    out = list(dict.fromkeys(fixed))
    seen = set(out)
    while len(out) < n:
        size = rng.choice([1, 2, 3, 5, 8, 13, 30])
        glue = rng.random() < 0.5  # glue pieces without spaces half of the time
        text = ("" if glue else " ").join(_piece(rng, specials) for _ in range(size))
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out

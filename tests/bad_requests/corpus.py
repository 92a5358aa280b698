"""A corpus of bad requests: each must be refused with a 4xx in OpenAI's error shape.

Every entry is refused by the gateway before anything reaches an engine, so the same corpus
runs against the built-in engine (one test per entry) and against a real vLLM engine (all of
it, then proof that the engine still serves). Bodies are JSON-able values or raw bytes; no
entry names a model, except the unknown-model ones, so they fit any served model.

Network discipline: image URLs pointing at loopback, private or link-local addresses are
refused by the fetcher before any connection (literal addresses, or `localhost` resolved from
/etc/hosts); nothing here is ever contacted.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class BadRequest:
    id: str
    category: str
    endpoint: str
    body: Any  # bytes are sent as is; anything else as JSON
    # The `param` the error must name (None: not checked, e.g. malformed JSON has none).
    param: str | None = None
    # Accepted statuses (all 4xx).
    statuses: tuple[int, ...] = (400,)

    def content(self) -> bytes:
        if isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body, allow_nan=True).encode()


def _msgs(content: Any = "hi") -> list[dict]:
    return [{"role": "user", "content": content}]


def _chat(**fields: Any) -> dict:
    return {"messages": _msgs(), "max_tokens": 8, **fields}


def _cmpl(**fields: Any) -> dict:
    return {"prompt": "Once upon a time", "max_tokens": 8, **fields}


# ----------------------------------------------------------------------------- images


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _png(width: int, height: int, *, rows: bool = True) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    out = b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr)
    if rows:
        raw = b"".join(b"\x00" + b"\x80\x40\x20" * width for _ in range(height))
        out += _png_chunk(b"IDAT", zlib.compress(raw))
    return out + _png_chunk(b"IEND", b"")


def _jpeg() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 30, 10)).save(buffer, "JPEG")
    return buffer.getvalue()


def _data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _image_chat(url: Any, *, stream: bool = False, extra_part: dict | None = None) -> dict:
    part = {"type": "image_url", "image_url": {"url": url}}
    content = [{"type": "text", "text": "Describe this."}, part] + ([extra_part] if extra_part else [])
    body = {"messages": _msgs(content), "max_tokens": 8}
    if stream:
        body["stream"] = True
    return body


def _image_cases() -> list[BadRequest]:
    png = _png(8, 6)
    jpeg = _jpeg()
    bad_uris = {
        "bad-base64": "data:image/png;base64,!!!not*base64###",
        "base64-wrong-padding": "data:image/png;base64,iVBORw0KGgo=A",
        "non-image-bytes": _data_uri(b"hello, I am plain text, not an image at all"),
        "html-bytes": _data_uri(b"<html><body>hi</body></html>", "text/html"),
        "empty-data": "data:image/png;base64,",
        "truncated-png": _data_uri(png[: len(png) // 2]),
        "png-signature-only": _data_uri(png[:8]),
        "png-header-without-pixels": _data_uri(_png(8, 6, rows=False)),
        "truncated-jpeg": _data_uri(jpeg[: len(jpeg) // 2], "image/jpeg"),
        "jpeg-soi-only": _data_uri(b"\xff\xd8\xff", "image/jpeg"),
        "png-bomb-50000x50000": _data_uri(_png(50000, 50000, rows=False)),
        "png-bomb-100000x1": _data_uri(_png(100000, 1000, rows=False)),
        "png-zero-size": _data_uri(_png(0, 0, rows=False)),
        "data-uri-no-comma": "data:image/png;base64",
        "ssrf-127.0.0.1": "http://127.0.0.1/image.png",
        "ssrf-127.0.0.1-port": "http://127.0.0.1:8265/api/jobs",
        "ssrf-10.0.0.1": "http://10.0.0.1/image.png",
        "ssrf-192.168.1.1": "http://192.168.1.1/image.png",
        "ssrf-172.16.0.1": "https://172.16.0.1/image.png",
        "ssrf-metadata": "http://169.254.169.254/latest/meta-data/",
        "ssrf-ipv6-loopback": "http://[::1]/image.png",
        "ssrf-ipv4-mapped-ipv6": "http://[::ffff:127.0.0.1]/image.png",
        "ssrf-localhost": "http://localhost/image.png",
        "ssrf-0.0.0.0": "http://0.0.0.0/image.png",
        "file-etc-passwd": "file:///etc/passwd",
        "file-relative-escape": "file://../etc/passwd",
        "file-proc-environ": "file:///proc/self/environ",
        "scheme-ftp": "ftp://example.com/a.png",
        "scheme-javascript": "javascript:alert(1)",
        "scheme-gopher": "gopher://127.0.0.1:6379/_INFO",
        "no-scheme": "image.png",
        "empty-url": "",
    }
    cases = [BadRequest(f"image-{name}", "images", CHAT, _image_chat(url)) for name, url in bad_uris.items()]
    for name in ("bad-base64", "truncated-png", "png-bomb-50000x50000", "ssrf-metadata", "file-etc-passwd"):
        cases.append(BadRequest(f"image-{name}-stream", "images", CHAT, _image_chat(bad_uris[name], stream=True)))
    too_many = [{"type": "image_url", "image_url": {"url": _data_uri(png)}} for _ in range(9)]
    cases += [
        BadRequest("image-too-many", "images", CHAT, {"messages": _msgs(too_many), "max_tokens": 8}, "messages", (413,)),
        BadRequest("image-too-many-stream", "images", CHAT,
                   {"messages": _msgs(too_many), "max_tokens": 8, "stream": True}, "messages", (413,)),
        # Larger than images.max_image_bytes (20 MiB), within the 32 MiB request limit.
        BadRequest("image-oversize-21MiB", "images", CHAT,
                   _image_chat(_data_uri(png[:33] + b"\x00" * (21 * 1024 * 1024))), "messages", (413,)),
        BadRequest("image-url-missing", "images", CHAT, _image_chat(None) | {"messages": _msgs(
            [{"type": "image_url", "image_url": {}}])}),
        BadRequest("image-url-not-string", "images", CHAT, _image_chat(12345)),
        BadRequest("image-url-object-missing", "images", CHAT, {"messages": _msgs([{"type": "image_url"}])}),
        BadRequest("image-detail-invalid", "images", CHAT, {"messages": _msgs(
            [{"type": "image_url", "image_url": {"url": _data_uri(png), "detail": "ultra"}}])}),
    ]
    return cases


# ----------------------------------------------------------------------------- malformed bodies


def _malformed_cases() -> list[BadRequest]:
    good = json.dumps(_chat()).encode()
    raw = {
        "empty-body": b"",
        "whitespace-body": b"   \n ",
        "truncated-json": b'{"messages": [{"role": "user", "content": "hi"',
        "truncated-string": b'{"messages": [{"role": "user", "content": "hi',
        "trailing-garbage": good + b"garbage",
        "two-objects": good + good,
        "top-level-array": b"[" + good + b"]",
        "top-level-string": b'"hello"',
        "top-level-number": b"42",
        "top-level-null": b"null",
        "top-level-true": b"true",
        "invalid-utf8": b'{"messages": [{"role": "user", "content": "\xff\xfe\xfa"}]}',
        "lone-surrogate": b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        "nan-literal": b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        "infinity-literal": b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
        "neg-infinity-literal": b'{"messages": [{"role": "user", "content": "hi"}], "top_p": -Infinity}',
        "huge-float": b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
        "huge-int-max-tokens": b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 400 + b"}",
        "huge-int-seed": b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"9" * 40 + b"}",
        "huge-int-top-k": b'{"messages": [{"role": "user", "content": "hi"}], "top_k": ' + b"9" * 30 + b"}",
        "single-quotes": b"{'messages': [{'role': 'user', 'content': 'hi'}]}",
        "trailing-comma": b'{"messages": [{"role": "user", "content": "hi"},]}',
        "comment": b'{"messages": [{"role": "user", "content": "hi"}] /* c */}',
        "deeply-nested": b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        "utf16-body": json.dumps(_chat()).encode("utf-16"),
        "control-char-in-string": b'{"messages": [{"role": "user", "content": "a\x01b"}]}',
    }
    cases = [BadRequest(f"malformed-{name}", "malformed", CHAT, body) for name, body in raw.items()]
    cases += [
        BadRequest("malformed-completions-truncated", "malformed", COMPLETIONS, b'{"prompt": "x", "max_tokens": '),
        BadRequest("malformed-completions-array", "malformed", COMPLETIONS, b'["prompt"]'),
        BadRequest("malformed-completions-nan", "malformed", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}'),
        BadRequest("malformed-completions-invalid-utf8", "malformed", COMPLETIONS, b'{"prompt": "\xc3\x28"}'),
        BadRequest("malformed-oversize-body-33MiB", "malformed", CHAT,
                   b'{"messages": [{"role": "user", "content": "' + b"a" * (33 * 1024 * 1024) + b'"}]}',
                   statuses=(413,)),
    ]
    return cases


# ----------------------------------------------------------------------------- wrong types


def _type_cases() -> list[BadRequest]:
    wrong: dict[str, list[Any]] = {
        "temperature": ["hot", True, [0.5], {"v": 1}],
        "top_p": ["0.9", False],
        "top_k": [1.5, "5"],
        "min_p": ["0.1"],
        "n": [1.0, "2", None.__class__.__name__],
        "max_tokens": [8.5, "8", [8]],
        "seed": [1.5, "7"],
        "stop": [5, [1, 2], {"s": "x"}],
        "stop_token_ids": ["1", [1.5], [None]],
        "presence_penalty": ["0"],
        "frequency_penalty": [[0]],
        "repetition_penalty": ["1.1"],
        "logit_bias": [[1, 2], {"1": "x"}, "1:5"],
        "ignore_eos": ["yes", 1],
        "min_tokens": [1.5, "1"],
        "stream": ["true", 1],
        "stream_options": ["yes", {"include_usage": "yes"}],
        "skip_special_tokens": [0],
        "bad_words": ["word", [1]],
        "allowed_token_ids": [["1"], 5],
        "structured_outputs": ["json", [1], {"json_object": "true"}, {"choice": "a"}],
        "response_format": ["json", ["json_object"]],
        "user": [5],
        "model": [5, ["m"]],
    }
    cases = []
    for field, values in wrong.items():
        for i, value in enumerate(values):
            cases.append(BadRequest(f"type-chat-{field}-{i}", "wrong types", CHAT, _chat(**{field: value})))
    chat_only = {
        "messages": ["hi", {"role": "user"}, None, [["user", "hi"]]],
        "logprobs": ["yes"],
        "top_logprobs": ["5"],
        "add_generation_prompt": ["no"],
        "max_completion_tokens": ["8"],
        "tools": ["none"],
    }
    for field, values in chat_only.items():
        for i, value in enumerate(values):
            body = _chat(**{field: value}) if field != "messages" else {"messages": value}
            cases.append(BadRequest(f"type-chat-{field}-{i}", "wrong types", CHAT, body))
    for i, value in enumerate([None, 5, {"text": "x"}, [1.5], [[1], ["a"]], [True], ["a", 1]]):
        cases.append(BadRequest(f"type-completions-prompt-{i}", "wrong types", COMPLETIONS,
                                {"prompt": value, "max_tokens": 8}))
    for field, value in {"echo": "yes", "logprobs": True, "suffix": 5, "temperature": "0", "n": 1.5}.items():
        cases.append(BadRequest(f"type-completions-{field}", "wrong types", COMPLETIONS, _cmpl(**{field: value})))
    cases.append(BadRequest("type-completions-missing-prompt", "wrong types", COMPLETIONS, {"max_tokens": 8}))
    return cases


# ----------------------------------------------------------------------------- messages


def _message_cases() -> list[BadRequest]:
    bodies = {
        "empty-list": ({"messages": []}, "messages"),
        "missing": ({"max_tokens": 8}, "messages"),
        "role-wizard": ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        "role-missing": ({"messages": [{"content": "hi"}]}, "messages.0.role"),
        "role-number": ({"messages": [{"role": 1, "content": "hi"}]}, "messages.0.role"),
        "role-uppercase": ({"messages": [{"role": "USER", "content": "hi"}]}, "messages.0.role"),
        "content-number": ({"messages": [{"role": "user", "content": 5}]}, None),
        "content-object": ({"messages": [{"role": "user", "content": {"text": "hi"}}]}, None),
        "part-type-unknown": ({"messages": _msgs([{"type": "video_url", "video_url": {"url": "x"}}])}, None),
        "part-type-missing": ({"messages": _msgs([{"text": "hi"}])}, None),
        "part-text-number": ({"messages": _msgs([{"type": "text", "text": 5}])}, None),
        "part-text-missing": ({"messages": _msgs([{"type": "text"}])}, None),
        "part-text-null": ({"messages": _msgs([{"type": "text", "text": None}])}, None),
        "part-not-object": ({"messages": _msgs(["hi"])}, None),
        "message-not-object": ({"messages": ["hi"]}, None),
        "name-number": ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, None),
        "both-generation-flags": (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
             "add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
        "too-long-prompt": ({"messages": _msgs("lorem ipsum dolor " * 3000), "max_tokens": 8}, "messages"),
        "too-long-prompt-stream": ({"messages": _msgs("lorem ipsum dolor " * 3000), "stream": True}, "messages"),
        "too-long-with-max-tokens": ({"messages": _msgs("hi"), "max_tokens": 10**6}, "max_tokens"),
        "max-tokens-and-completion-tokens-disagree": (_chat(max_completion_tokens=9), "max_completion_tokens"),
        "unknown-model": (_chat(model="gpt-17"), "model"),
        "unknown-model-stream": (_chat(model="no-such-model", stream=True), "model"),
        "top-logprobs-without-logprobs": (_chat(top_logprobs=2), "top_logprobs"),
        "top-logprobs-negative": (_chat(logprobs=True, top_logprobs=-2), "top_logprobs"),
        "top-logprobs-beyond-max": (_chat(logprobs=True, top_logprobs=21), "logprobs"),
        "truncate-prompt-tokens": (_chat(truncate_prompt_tokens=5), "truncate_prompt_tokens"),
        "prompt-logprobs-beyond-max": (_chat(prompt_logprobs=21), "prompt_logprobs"),
        "prompt-logprobs-negative": (_chat(prompt_logprobs=-3), "prompt_logprobs"),
        "prompt-logprobs-streamed": (_chat(prompt_logprobs=1, stream=True), "prompt_logprobs"),
    }
    return [BadRequest(f"messages-{name}", "messages", CHAT, body, param) for name, (body, param) in bodies.items()]


# ----------------------------------------------------------------------------- prompts


def _prompt_cases() -> list[BadRequest]:
    bodies = {
        "empty-string": ({"prompt": "", "max_tokens": 8}, "prompt"),
        "empty-token-list": ({"prompt": [], "max_tokens": 8}, "prompt"),
        "token-out-of-vocab": ({"prompt": [1, 2, 10**9], "max_tokens": 8}, "prompt"),
        "token-negative": ({"prompt": [1, -5], "max_tokens": 8}, "prompt"),
        "token-beyond-int64": ({"prompt": [1, 2**70], "max_tokens": 8}, "prompt"),
        "batched-prompts": ({"prompt": ["a", "b"], "max_tokens": 8}, "prompt"),
        "batched-token-prompts": ({"prompt": [[1, 2], [3, 4]], "max_tokens": 8}, "prompt"),
        "too-long-text": ({"prompt": "lorem ipsum dolor " * 3000, "max_tokens": 8}, "prompt"),
        "too-long-tokens": ({"prompt": [100] * 5000, "max_tokens": 8}, "prompt"),
        "too-long-tokens-stream": ({"prompt": [100] * 5000, "stream": True}, "prompt"),
        "max-tokens-overflow": (_cmpl(max_tokens=10**6), "max_tokens"),
        "max-tokens-zero-without-echo": (_cmpl(max_tokens=0), "max_tokens"),
        "suffix": (_cmpl(suffix="end"), "suffix"),
        "logprobs-negative": (_cmpl(logprobs=-2), "logprobs"),
        "logprobs-beyond-max": (_cmpl(logprobs=21), "logprobs"),
        "logprobs-with-echo-beyond-max": (_cmpl(logprobs=21, echo=True), "logprobs"),
        "prompt-logprobs-streamed": (_cmpl(prompt_logprobs=3, stream=True), "prompt_logprobs"),
        "unknown-model": (_cmpl(model="text-davinci-003"), "model"),
        "truncate-prompt-tokens": (_cmpl(truncate_prompt_tokens=-1), "truncate_prompt_tokens"),
    }
    return [BadRequest(f"prompt-{name}", "prompts", COMPLETIONS, body, param) for name, (body, param) in bodies.items()]


# ----------------------------------------------------------------------------- sampling ranges


def _sampling_cases() -> list[BadRequest]:
    out_of_range: list[tuple[str, Any, str]] = [
        ("temperature", -0.5, "temperature"),
        ("temperature", 2.5, "temperature"),
        ("temperature", 1e308, "temperature"),
        ("top_p", 0, "top_p"),
        ("top_p", -0.1, "top_p"),
        ("top_p", 1.01, "top_p"),
        ("top_k", -2, "top_k"),
        ("top_k", 2**63, "top_k"),
        ("min_p", -0.01, "min_p"),
        ("min_p", 1.5, "min_p"),
        ("presence_penalty", 2.5, "presence_penalty"),
        ("presence_penalty", -3, "presence_penalty"),
        ("frequency_penalty", 2.01, "frequency_penalty"),
        ("frequency_penalty", -2.01, "frequency_penalty"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("repetition_penalty", -1, "repetition_penalty"),
        ("n", 0, "n"),
        ("n", -1, "n"),
        ("n", 17, "n"),
        ("n", 10**12, "n"),
        ("max_tokens", 0, "max_tokens"),
        ("max_tokens", -1, "max_tokens"),
        ("min_tokens", -1, "min_tokens"),
        ("min_tokens", 9, "min_tokens"),
        ("seed", 2**64, "seed"),
        ("seed", -(2**63) - 1, "seed"),
        ("stop", [""], "stop"),
        ("stop", ["s"] * 17, "stop"),
        ("stop", ["x" * 513], "stop"),
        ("stop", "", "stop"),
        ("stop_token_ids", [10**9], "stop_token_ids"),
        ("stop_token_ids", [-1], "stop_token_ids"),
        ("stop_token_ids", [1] * 5000, "stop_token_ids"),
        ("logit_bias", {"abc": 1}, "logit_bias"),
        ("logit_bias", {"1.5": 1}, "logit_bias"),
        ("logit_bias", {"": 1}, "logit_bias"),
        ("logit_bias", {"10000000000": 1}, "logit_bias"),
        ("logit_bias", {"-1": 1}, "logit_bias"),
        ("logit_bias", {"5": 101}, "logit_bias"),
        ("logit_bias", {"5": -1000}, "logit_bias"),
        ("logit_bias", {str(i): 1 for i in range(1100)}, "logit_bias"),
        ("allowed_token_ids", [], "allowed_token_ids"),
        ("allowed_token_ids", [10**9], "allowed_token_ids"),
        ("allowed_token_ids", [-3], "allowed_token_ids"),
        ("bad_words", [""], "bad_words"),
        ("bad_words", ["   "], "bad_words"),
        ("bad_words", ["w" * 600], "bad_words"),
        ("bad_words", [f"word{i}" for i in range(200)], "bad_words"),
    ]
    cases = []
    for i, (field, value, param) in enumerate(out_of_range):
        cases.append(BadRequest(f"sampling-chat-{field}-{i}", "sampling ranges", CHAT, _chat(**{field: value}), param))
        cases.append(BadRequest(f"sampling-completions-{field}-{i}", "sampling ranges", COMPLETIONS,
                                _cmpl(**{field: value}), param))
    for name, body, param in [
        ("n-greedy", _chat(n=2, temperature=0), "n"),
        ("temperature-nan-stream", b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, "temperature": NaN}', None),
        ("top-p-zero-stream", _chat(top_p=0, stream=True), "top_p"),
        ("n-zero-stream", _chat(n=0, stream=True), "n"),
        ("logit-bias-stream", _chat(logit_bias={"x": 1}, stream=True), "logit_bias"),
    ]:
        cases.append(BadRequest(f"sampling-{name}", "sampling ranges", CHAT, body, param))
    return cases


# ----------------------------------------------------------------------------- structured outputs


def _nested(depth: int) -> dict:
    node: dict = {"type": "string"}
    for _ in range(depth):
        node = {"type": "object", "properties": {"a": node}}
    return node


def _structured_cases() -> list[BadRequest]:
    so = "structured_outputs"
    rf = "response_format"
    specs: list[tuple[str, dict, str]] = [
        ("none", {so: {}}, so),
        ("only-options", {so: {"disable_any_whitespace": True}}, so),
        ("json-and-regex", {so: {"json": {"type": "object"}, "regex": "a+"}}, so),
        ("choice-and-grammar", {so: {"choice": ["a"], "grammar": "root ::= \"a\""}}, so),
        ("json-empty-string", {so: {"json": ""}}, so),
        ("json-blank-string", {so: {"json": "   "}}, so),
        ("json-unparseable", {so: {"json": "{\"type\": "}}, so),
        ("json-string-array", {so: {"json": "[1, 2]"}}, so),
        ("json-string-number", {so: {"json": "42"}}, so),
        ("json-type-number", {so: {"json": {"type": 5}}}, so),
        ("json-type-unknown", {so: {"json": {"type": "strang"}}}, so),
        ("json-properties-list", {so: {"json": {"type": "object", "properties": ["a"]}}}, so),
        ("json-property-not-schema", {so: {"json": {"type": "object", "properties": {"a": 5}}}}, so),
        ("json-required-not-list", {so: {"json": {"type": "object", "required": "a"}}}, so),
        ("json-enum-empty", {so: {"json": {"enum": []}}}, so),
        ("json-bad-pattern", {so: {"json": {"type": "string", "pattern": "(unclosed"}}}, so),
        ("json-min-gt-max", {so: {"json": {"type": "string", "minLength": 5, "maxLength": 2}}}, so),
        ("json-multipleof", {so: {"json": {"type": "integer", "multipleOf": 3}}}, so),
        ("json-unique-items", {so: {"json": {"type": "array", "uniqueItems": True}}}, so),
        ("json-unknown-format", {so: {"json": {"type": "string", "format": "credit-card"}}}, so),
        ("json-allof-branches", {so: {"json": {"allOf": [{"type": "string"}, {"enum": ["a"]}]}}}, so),
        ("json-nested-too-deep", {so: {"json": _nested(70)}}, so),
        ("json-string-nested-too-deep", {so: {"json": json.dumps(_nested(70))}}, so),
        ("json-oversize", {so: {"json": {"type": "object", "description": "d" * 300_000}}}, so),
        ("regex-unclosed", {so: {"regex": "(abc"}}, so),
        ("regex-bad-escape", {so: {"regex": "\\"}}, so),
        ("regex-bad-repeat", {so: {"regex": "a**"}}, so),
        ("regex-bad-range", {so: {"regex": "[z-a]"}}, so),
        ("regex-nul", {so: {"regex": "a\x00b"}}, so),
        ("regex-lookahead", {so: {"regex": "a(?=b)"}}, so),
        ("regex-backreference", {so: {"regex": "(a)\\1"}}, so),
        ("regex-too-long", {so: {"regex": "a" * 20000}}, so),
        ("choice-empty", {so: {"choice": []}}, so),
        ("choice-too-many", {so: {"choice": [f"c{i}" for i in range(1100)]}}, so),
        ("grammar-empty", {so: {"grammar": ""}}, so),
        ("grammar-blank", {so: {"grammar": "  \n "}}, so),
        ("grammar-no-root", {so: {"grammar": "start ::= \"a\""}}, so),
        ("grammar-not-a-grammar", {so: {"grammar": "hello world"}}, so),
        ("grammar-nul", {so: {"grammar": "root ::= \"a\x00\""}}, so),
        ("grammar-oversize", {so: {"grammar": "root ::= \"" + "a" * 300_000 + "\""}}, so),
        # Refused by the grammar compiler the engine runs (xgrammar), as vLLM's front end refuses them.
        ("grammar-undefined-rule", {so: {"grammar": "root ::= b"}}, so),
        ("grammar-dangling-or", {so: {"grammar": "root ::= \"a\" |"}}, so),
        ("grammar-two-roots", {so: {"grammar": "root ::= \"a\"\nroot ::= \"b\""}}, so),
        ("grammar-slash-comment", {so: {"grammar": "// c\nroot ::= \"a\""}}, so),
        ("grammar-reversed-class", {so: {"grammar": "root ::= [z-a]"}}, so),
        ("grammar-unterminated-string", {so: {"grammar": "root ::= \"abc"}}, so),
        ("grammar-lark-undefined-rule", {so: {"grammar": "start: b"}}, so),
        ("grammar-lark-two-starts", {so: {"grammar": "start: \"a\"\nstart: \"b\""}}, so),
        ("grammar-lark-lookahead", {so: {"grammar": "start: /(?=a)b/"}}, so),
        ("json-missing-ref", {so: {"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}}}, so),
        ("json-pattern-unicode-class", {so: {"json": {"type": "string", "pattern": "\\p{L}+"}}}, so),
        ("json-empty-exclusive-range", {so: {"json": {"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 5}}}, so),
        ("json-minimum-not-number", {so: {"json": {"type": "integer", "minimum": "one"}}}, so),
        ("json-string-of-a-string", {so: {"json": "\"a\""}}, so),
        ("regex-unicode-class", {so: {"regex": "\\p{L}+"}}, so),
        ("regex-possessive", {so: {"regex": "a++"}}, so),
        ("regex-word-boundary", {so: {"regex": "\\bword\\b"}}, so),
        ("regex-inline-flag", {so: {"regex": "(?i)abc"}}, so),
        ("regex-empty-class", {so: {"regex": "[]a]"}}, so),
        ("regex-open-count", {so: {"regex": "a{,3}"}}, so),
        ("whitespace-pattern-lookahead", {so: {"json_object": True, "whitespace_pattern": "(?= )"}}, so),
        ("rf-json-schema-missing-ref", {rf: {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/none"}}}}, rf),
        ("json-object-false", {so: {"json_object": False}}, so),
        ("structural-tag", {so: {"structural_tag": "{\"type\": \"structural_tag\"}"}}, so),
        ("whitespace-pattern-bad", {so: {"json_object": True, "whitespace_pattern": "[ "}}, so),
        ("rf-type-unknown", {rf: {"type": "yaml"}}, rf),
        ("rf-type-missing", {rf: {}}, rf),
        ("rf-type-number", {rf: {"type": 1}}, rf),
        ("rf-json-schema-missing", {rf: {"type": "json_schema"}}, rf),
        ("rf-json-schema-no-name", {rf: {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}, rf),
        ("rf-json-schema-no-schema", {rf: {"type": "json_schema", "json_schema": {"name": "x"}}}, rf),
        ("rf-json-schema-string-schema", {rf: {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}}, rf),
        ("rf-json-schema-bad-type", {rf: {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}}, rf),
        ("rf-json-schema-too-deep", {rf: {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(70)}}}, rf),
        ("rf-structural-tag", {rf: {"type": "structural_tag", "format": {}}}, rf),
        ("rf-plus-structured-regex", {rf: {"type": "json_object"}, so: {"regex": "a+"}}, rf),
    ]
    cases = [BadRequest(f"structured-chat-{name}", "structured outputs", CHAT, _chat(**fields), param)
             for name, fields, param in specs]
    for name, fields, param in specs[::3]:
        cases.append(BadRequest(f"structured-completions-{name}", "structured outputs", COMPLETIONS, _cmpl(**fields), param))
    for name, fields, param in specs[1::6]:
        cases.append(BadRequest(f"structured-chat-{name}-stream", "structured outputs", CHAT,
                                _chat(stream=True, **fields), param))
    return cases


# ----------------------------------------------------------------------------- tools

_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _tool_call(**function: Any) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}", **function}}


def _history(*tool_calls: Any, **assistant: Any) -> list[dict]:
    return [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": list(tool_calls),
            **assistant}, {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]  # fmt: skip


def _tool_cases() -> list[BadRequest]:
    """Tools and tool_choice as vLLM's `check_tool_usage` refuses them, then what a server without a
    tool-call parser refuses (as `vllm serve` without `--tool-call-parser` does), then bad tool shapes."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    bodies = {
        "empty-list": (_chat(tools=[]), "tools"),
        "tools-default-to-auto": (_chat(tools=[_TOOL]), "tool_choice"),
        "tools-default-to-auto-stream": (_chat(tools=[_TOOL], stream=True), "tool_choice"),
        "auto": (_chat(tools=[_TOOL], tool_choice="auto"), "tool_choice"),
        "required": (_chat(tools=[_TOOL], tool_choice="required"), "tool_choice"),
        "named": (_chat(tools=[_TOOL], tool_choice=named), "tool_choice"),
        "choice-without-tools": (_chat(tool_choice="required"), "tool_choice"),
        "named-without-tools": (_chat(tool_choice=named), "tool_choice"),
        "choice-unknown-word": (_chat(tools=[_TOOL], tool_choice="always"), "tool_choice"),
        "choice-number": (_chat(tools=[_TOOL], tool_choice=1), None),
        "named-unknown-function": (_chat(tools=[_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
                                   "tool_choice"),  # fmt: skip
        "named-function-missing": (_chat(tools=[_TOOL], tool_choice={"type": "function"}), "tool_choice.function"),
        "named-function-string": (_chat(tools=[_TOOL], tool_choice={"type": "function", "function": "get_weather"}),
                                  "tool_choice.function"),  # fmt: skip
        "named-name-missing": (_chat(tools=[_TOOL], tool_choice={"type": "function", "function": {}}),
                               "tool_choice.function.name"),  # fmt: skip
        "named-name-empty": (_chat(tools=[_TOOL], tool_choice={"type": "function", "function": {"name": ""}}),
                             "tool_choice.function.name"),  # fmt: skip
        "named-name-number": (_chat(tools=[_TOOL], tool_choice={"type": "function", "function": {"name": 7}}),
                              "tool_choice.function.name"),  # fmt: skip
        "tool-not-object": (_chat(tools=["get_weather"]), None),
        "tool-function-missing": (_chat(tools=[{"type": "function"}], tool_choice="none"), "tools.0.function"),
        "tool-type-unknown": (_chat(tools=[{"type": "retrieval", "function": {"name": "f"}}], tool_choice="none"),
                              "tools.0.type"),  # fmt: skip
        "tool-name-missing": (_chat(tools=[{"type": "function", "function": {}}], tool_choice="none"),
                              "tools.0.function.name"),  # fmt: skip
        "tool-name-number": (_chat(tools=[{"type": "function", "function": {"name": 5}}], tool_choice="none"),
                             "tools.0.function.name"),  # fmt: skip
        "tool-parameters-not-object": (
            _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}], tool_choice="none"),
            "tools.0.function.parameters"),
        "tool-strict-string": (
            _chat(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}], tool_choice="none"),
            "tools.0.function.strict"),
        "history-tool-calls-not-list": (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": {"id": "x"}}]},
            None),
        "history-tool-call-not-object": ({"messages": _history("call_1")}, None),
        "history-tool-call-type-unknown": ({"messages": _history(_tool_call() | {"type": "retrieval"})}, None),
        "history-tool-call-id-missing": ({"messages": _history({"type": "function", "function": {"name": "f", "arguments": "{}"}})},
                                         None),  # fmt: skip
        "history-tool-call-function-missing": ({"messages": _history({"id": "c", "type": "function"})}, None),
        "history-tool-call-name-missing": ({"messages": _history({"id": "c", "type": "function", "function": {"arguments": "{}"}})}, None),
        "history-tool-call-arguments-object": ({"messages": _history(_tool_call(arguments={"city": "Paris"}))}, None),
        "history-tool-call-arguments-missing": ({"messages": _history({"id": "c", "type": "function", "function": {"name": "f"}})},
                                                None),  # fmt: skip
        "history-tool-call-id-number": ({"messages": _history(_tool_call() | {"id": 1})}, None),
        "tool-message-call-id-number": (
            {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r", "tool_call_id": 3}]}, None),
        # vLLM's `check_structured_outputs_count`: a json, regex or choice constraint with a named function
        # or an explicit null tool_choice.
        "constraint-with-named": (_chat(tools=[_TOOL], tool_choice=named, structured_outputs={"regex": "a+"}), "tool_choice"),
        "constraint-with-null-choice": (_chat(tool_choice=None, structured_outputs={"choice": ["a", "b"]}), "tool_choice"),
    }
    return [BadRequest(f"tools-{name}", "tools", CHAT, body, param) for name, (body, param) in bodies.items()]


# Refused only by a server without a tool-call parser (and auto tool choice): one with them serves these.
SERVED_WITH_A_TOOL_CALL_PARSER = frozenset(
    {"tools-tools-default-to-auto", "tools-tools-default-to-auto-stream", "tools-auto", "tools-required", "tools-named"}
)


def build_corpus() -> list[BadRequest]:
    corpus = (
        _malformed_cases() + _type_cases() + _message_cases() + _prompt_cases()
        + _sampling_cases() + _structured_cases() + _tool_cases() + _image_cases()
    )
    ids = [case.id for case in corpus]
    duplicates = {i for i in ids if ids.count(i) > 1}
    assert not duplicates, duplicates
    return corpus


CORPUS = build_corpus()

"""Request checks that vLLM's front-end would make, made here before anything reaches an engine.

Going direct to EngineCore skips vLLM's own API-server validation, and the engine treats
some bad values as fatal. Each check names the offending field in the 400 it raises.
Ranges follow `vllm.sampling_params.SamplingParams._verify_args` (vLLM 0.32).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

try:  # Python 3.11+
    import re._parser as _sre_parse  # type: ignore[import-not-found]
    import re._constants as _sre_constants  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    import sre_constants as _sre_constants  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

from mmserve.wire import StructuredOutputsParams

from .config import LimitsConfig
from .errors import bad_request
from .schemas import ChatCompletionRequest, CompletionRequest, SamplingRequestFields, StructuredOutputsRequest

_INT64_MIN, _INT64_MAX, _UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1

# Caps on request-sized inputs (vLLM's are in brackets where it has one).
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_TOKEN_ID_LIST = 4096  # stop_token_ids, allowed_token_ids
MAX_BAD_WORDS_TOKEN_SEQUENCES = 128  # [VLLM_MAX_NUM_BAD_WORDS]
MAX_BAD_WORD_CHARS = 512
MAX_JSON_NESTING = 64  # [MAX_STRUCTURED_OUTPUT_JSON_NESTING]
MAX_SCHEMA_CHARS = 256 * 1024
MAX_REGEX_CHARS = 16 * 1024
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096
# The grammar backend mmserve asks engines for: vLLM's "auto" resolves to xgrammar, and an
# engine keeps the backend of its first structured request, so only xgrammar is used.
STRUCTURED_BACKEND = "xgrammar"


def _check_unsupported(request: SamplingRequestFields) -> None:
    if request.truncate_prompt_tokens is not None:
        raise bad_request("truncate_prompt_tokens is not supported by this server", "truncate_prompt_tokens")
    if request.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs are not supported by this server yet", "prompt_logprobs")


def check_chat_request(request: ChatCompletionRequest) -> None:
    _check_unsupported(request)
    if request.logprobs or request.top_logprobs:
        raise bad_request("logprobs are not supported by this server yet", "logprobs")
    if request.tools:
        raise bad_request("tool calling is not supported by this server yet", "tools")
    if request.add_generation_prompt and request.continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true", "continue_final_message")
    if request.max_completion_tokens is not None and request.max_tokens is not None and request.max_completion_tokens != request.max_tokens:
        raise bad_request("max_tokens and max_completion_tokens disagree; send one of them", "max_completion_tokens")


def check_completion_request(request: CompletionRequest) -> None:
    _check_unsupported(request)
    if request.echo:
        raise bad_request("echo is not supported by this server yet", "echo")
    if request.suffix:
        raise bad_request("suffix is not supported by this server", "suffix")
    if request.logprobs is not None:
        raise bad_request("logprobs are not supported by this server yet", "logprobs")


def check_token_ids(token_ids: list[int], max_token_id: int, param: str) -> None:
    for token_id in token_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise bad_request(f"token ids must be integers, got {token_id!r}", param)
        if not 0 <= token_id <= max_token_id:
            raise bad_request(f"token id {token_id} is out of vocabulary (0..{max_token_id})", param)


def _finite(value: float | None, param: str) -> None:
    if value is not None and not math.isfinite(value):
        raise bad_request(f"{param} must be a finite number, got {value}", param)


def check_sampling(request: SamplingRequestFields, max_tokens: int, limits: LimitsConfig, max_token_id: int) -> None:
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        _finite(getattr(request, name), name)
    if not 1 <= request.n <= limits.max_n:
        raise bad_request(f"n must be between 1 and {limits.max_n}, got {request.n}", "n")
    if request.temperature is not None and not 0.0 <= request.temperature <= 2.0:
        raise bad_request(f"temperature must be in [0, 2], got {request.temperature}", "temperature")
    if request.top_p is not None and not 0.0 < request.top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {request.top_p}", "top_p")
    if request.top_k is not None and not -1 <= request.top_k <= _INT64_MAX:
        raise bad_request(f"top_k must be -1 or 0 (disabled), or at least 1, got {request.top_k}", "top_k")
    if request.n > 1 and request.temperature is not None and request.temperature < 1e-5:
        # vLLM's SamplingParams._verify_greedy_sampling.
        raise bad_request(f"n must be 1 when using greedy sampling (temperature=0), got {request.n}", "n")
    if request.min_p is not None and not 0.0 <= request.min_p <= 1.0:
        raise bad_request(f"min_p must be in [0, 1], got {request.min_p}", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(request, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise bad_request(f"{name} must be in [-2, 2], got {value}", name)
    if request.repetition_penalty is not None and request.repetition_penalty <= 0.0:
        raise bad_request(f"repetition_penalty must be greater than zero, got {request.repetition_penalty}", "repetition_penalty")
    if max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if request.min_tokens < 0:
        raise bad_request(f"min_tokens must be at least 0, got {request.min_tokens}", "min_tokens")
    if request.min_tokens > max_tokens:
        raise bad_request(f"min_tokens must be at most max_tokens={max_tokens}, got {request.min_tokens}", "min_tokens")
    if request.seed is not None and not _INT64_MIN <= request.seed <= _UINT64_MAX:
        raise bad_request("seed must fit in 64 bits", "seed")
    stop = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
    if len(stop) > limits.max_stop_strings:
        raise bad_request(f"at most {limits.max_stop_strings} stop strings are allowed", "stop")
    for s in stop:
        if not s:
            raise bad_request("stop cannot contain an empty string", "stop")
        if len(s) > limits.max_stop_string_chars:
            raise bad_request(f"stop strings are limited to {limits.max_stop_string_chars} characters", "stop")
    for name in ("stop_token_ids", "allowed_token_ids"):
        ids = getattr(request, name)
        if ids is not None and len(ids) > MAX_TOKEN_ID_LIST:
            raise bad_request(f"{name} is limited to {MAX_TOKEN_ID_LIST} token ids", name)
        check_token_ids(ids or [], max_token_id, name)
    if request.allowed_token_ids is not None and not request.allowed_token_ids:
        raise bad_request("allowed_token_ids cannot be an empty list", "allowed_token_ids")
    for word in request.bad_words or []:
        if not word or not word.strip():
            raise bad_request("bad_words cannot contain an empty or blank string", "bad_words")
        if len(word) > MAX_BAD_WORD_CHARS:
            raise bad_request(f"bad_words entries are limited to {MAX_BAD_WORD_CHARS} characters", "bad_words")
    if request.bad_words and len(request.bad_words) > MAX_BAD_WORDS_TOKEN_SEQUENCES:
        raise bad_request(f"at most {MAX_BAD_WORDS_TOKEN_SEQUENCES} bad_words are allowed", "bad_words")
    if request.logit_bias and len(request.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"logit_bias is limited to {MAX_LOGIT_BIAS_ENTRIES} entries", "logit_bias")
    for key, bias in (request.logit_bias or {}).items():
        try:
            if not key.strip().lstrip("+-").isdigit():
                raise ValueError(key)
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        check_token_ids([token_id], max_token_id, "logit_bias")
        if not math.isfinite(bias) or not -100.0 <= bias <= 100.0:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {bias}", "logit_bias")


def bad_words_token_ids(bad_words: list[str], encode, max_token_id: int) -> list[list[int]] | None:
    """`SamplingParams.update_from_tokenizer` of vLLM 0.32: each bad word as token ids, with
    and without a leading space. The engine reads only these ids, never `bad_words`."""
    if not bad_words:
        return None
    sequences: list[list[int]] = []
    for word in dict.fromkeys(bad_words):
        for add_prefix_space in (False, True):
            ids = encode((" " if add_prefix_space else "") + word.lstrip())
            if not ids:
                if not add_prefix_space:
                    raise bad_request(f"bad_words entry {word[:40]!r} does not tokenize to any token", "bad_words")
                continue
            if not add_prefix_space or (ids[0] != sequences[-1][0] and len(ids) == len(sequences[-1])):
                sequences.append(ids)
                if len(sequences) > MAX_BAD_WORDS_TOKEN_SEQUENCES:
                    raise bad_request(
                        f"too many bad words after tokenization: at most {MAX_BAD_WORDS_TOKEN_SEQUENCES}", "bad_words"
                    )
    for ids in sequences:
        check_token_ids(ids, max_token_id, "bad_words")
    return sequences


# ----------------------------------------------------------------------------- structured outputs

_JSON_TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}
# xgrammar's supported string formats (vllm/v1/structured_output/backend_xgrammar.py).
_STRING_FORMATS = {
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                  "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def _exceeds_json_nesting(spec: Any, limit: int) -> bool:
    """vLLM's `_exceeds_json_nesting`: objects/arrays nested deeper than `limit`."""
    level = [spec]
    for _ in range(limit):
        level = [
            child
            for node in level
            if isinstance(node, (dict, list))
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return False
    return True


def _parse_json_spec(spec: str | dict, param: str, what: str) -> Any:
    if isinstance(spec, str):
        if not spec.strip():
            raise bad_request(f"{what} cannot be an empty string", param)
        if len(spec) > MAX_SCHEMA_CHARS:
            raise bad_request(f"{what} is limited to {MAX_SCHEMA_CHARS} characters", param)
        try:
            spec = json.loads(spec)
        except RecursionError:
            raise bad_request(f"{what} is nested too deeply", param) from None
        except ValueError as exc:
            raise bad_request(f"{what} is not valid JSON: {exc}", param) from None
    else:
        # Bounded by the request size; re-serialised only to measure it.
        try:
            size = len(json.dumps(spec, allow_nan=False))
        except (ValueError, RecursionError):
            raise bad_request(f"{what} is not valid JSON (non-finite number or too deep)", param) from None
        if size > MAX_SCHEMA_CHARS:
            raise bad_request(f"{what} is limited to {MAX_SCHEMA_CHARS} characters", param)
    if _exceeds_json_nesting(spec, MAX_JSON_NESTING):
        raise bad_request(
            f"{what} is nested too deeply: objects and arrays may nest at most {MAX_JSON_NESTING} levels", param
        )
    return spec


def _check_schema_node(node: Any, param: str, path: str) -> None:
    """A structural sanity check of one JSON Schema node, and xgrammar's unsupported features
    (`has_xgrammar_unsupported_json_features` of vLLM 0.32, which would otherwise fall back to
    another backend that an engine already running xgrammar cannot use)."""
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise bad_request(f"JSON schema at {path} must be an object or a boolean, got {type(node).__name__}", param)
    kind = node.get("type")
    types: set[str] = set()
    if kind is not None:
        kinds = [kind] if isinstance(kind, str) else kind
        if not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) for k in kinds):
            raise bad_request(f"JSON schema at {path}: \"type\" must be a string or a non-empty list of strings", param)
        unknown = [k for k in kinds if k not in _JSON_TYPES]
        if unknown:
            raise bad_request(f"JSON schema at {path}: unknown type {unknown[0]!r}", param)
        types = set(kinds)
    for key in _SCHEMA_MAPS:
        if key in node:
            value = node[key]
            if not isinstance(value, dict):
                raise bad_request(f"JSON schema at {path}: \"{key}\" must be an object", param)
            for name, sub in value.items():
                _check_schema_node(sub, param, f"{path}.{key}.{name}")
    for key in _SCHEMA_LISTS:
        if key in node:
            value = node[key]
            if not isinstance(value, list) or not value:
                raise bad_request(f"JSON schema at {path}: \"{key}\" must be a non-empty array", param)
            for i, sub in enumerate(value):
                _check_schema_node(sub, param, f"{path}.{key}[{i}]")
    for key in _SCHEMA_VALUES:
        if key in node:
            _check_schema_node(node[key], param, f"{path}.{key}")
    if "required" in node and not (isinstance(node["required"], list) and all(isinstance(r, str) for r in node["required"])):
        raise bad_request(f"JSON schema at {path}: \"required\" must be an array of strings", param)
    if "enum" in node and not (isinstance(node["enum"], list) and node["enum"]):
        raise bad_request(f"JSON schema at {path}: \"enum\" must be a non-empty array", param)
    if "$ref" in node and not isinstance(node["$ref"], str):
        raise bad_request(f"JSON schema at {path}: \"$ref\" must be a string", param)
    if "pattern" in node:
        _check_regex(node["pattern"], param, f"JSON schema pattern at {path}")
    for key in ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"):
        if key in node and (isinstance(node[key], bool) or not isinstance(node[key], int) or node[key] < 0):
            raise bad_request(f"JSON schema at {path}: \"{key}\" must be a non-negative integer", param)
    for lo, hi in (("minLength", "maxLength"), ("minItems", "maxItems"), ("minimum", "maximum"), ("minProperties", "maxProperties")):
        a, b = node.get(lo), node.get(hi)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and a > b:
            raise bad_request(f"JSON schema at {path}: {lo} ({a}) is greater than {hi} ({b})", param)
    # Unsupported by xgrammar (vLLM would reject or switch backend).
    unsupported = None
    if types & {"integer", "number"} and "multipleOf" in node:
        unsupported = "multipleOf"
    elif "array" in types and any(k in node for k in ("uniqueItems", "contains", "minContains", "maxContains")):
        unsupported = "uniqueItems/contains on arrays"
    elif "string" in types and "format" in node and node["format"] not in _STRING_FORMATS:
        unsupported = f"string format {node['format']!r}"
    elif "string" in types and ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        unsupported = "pattern/format together with minLength/maxLength"
    elif "object" in types and "propertyNames" in node and (
        "patternProperties" in node or "properties" in node or node.get("unevaluatedProperties", True) is not True
        or (isinstance(node["propertyNames"], dict) and ("pattern" in node["propertyNames"] or "format" in node["propertyNames"])
            and ("minLength" in node["propertyNames"] or "maxLength" in node["propertyNames"]))
    ):
        unsupported = "propertyNames with properties/patternProperties/length bounds"
    elif "object" in types and isinstance(node.get("patternProperties"), dict) and (
        "properties" in node or len(node["patternProperties"]) > 1
    ):
        unsupported = "patternProperties with properties, or several patternProperties"
    elif isinstance(node.get("allOf"), list) and len(node["allOf"]) >= 2:
        unsupported = "allOf with several branches"
    if unsupported:
        raise bad_request(f"JSON schema at {path} uses a feature the grammar backend does not support: {unsupported}", param)


def check_json_schema(spec: str | dict, param: str) -> str | dict:
    schema = _parse_json_spec(spec, param, "the JSON schema")
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"the JSON schema must be a JSON object, got {type(schema).__name__}", param)
    _check_schema_node(schema, param, "#")
    return spec


_UNSUPPORTED_REGEX_OPS = {
    _sre_constants.ASSERT: "lookahead/lookbehind",
    _sre_constants.ASSERT_NOT: "negative lookahead/lookbehind",
    _sre_constants.GROUPREF: "backreferences",
    _sre_constants.GROUPREF_EXISTS: "conditional groups",
}


def _regex_ops(parsed) -> Any:
    for op, av in parsed:
        yield op
        values = av if isinstance(av, (list, tuple)) else [av]
        for value in values:
            if isinstance(value, _sre_parse.SubPattern):
                yield from _regex_ops(value)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, _sre_parse.SubPattern):
                        yield from _regex_ops(item)


def _check_regex(pattern: Any, param: str, what: str = "regex") -> None:
    if not isinstance(pattern, str):
        raise bad_request(f"{what} must be a string", param)
    if len(pattern) > MAX_REGEX_CHARS:
        raise bad_request(f"{what} is limited to {MAX_REGEX_CHARS} characters", param)
    if "\x00" in pattern:
        raise bad_request(f"{what} must not contain a NUL character", param)
    try:
        parsed = _sre_parse.parse(pattern)
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError, ValueError) as exc:
        raise bad_request(f"{what} does not compile: {exc}", param) from None
    for op in _regex_ops(parsed):
        if op in _UNSUPPORTED_REGEX_OPS:
            raise bad_request(f"{what} uses {_UNSUPPORTED_REGEX_OPS[op]}, which the grammar backend does not support", param)


def _check_grammar(grammar: str, param: str) -> None:
    if not grammar.strip():
        raise bad_request("structured_outputs.grammar cannot be an empty string", param)
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"structured_outputs.grammar is limited to {MAX_GRAMMAR_CHARS} characters", param)
    if "\x00" in grammar:
        raise bad_request("structured_outputs.grammar must not contain a NUL character", param)
    lines = [re.sub(r"(#|//).*$", "", line).strip() for line in grammar.split("\n")]
    rules = [line for line in lines if line]
    if any("::=" in line for line in rules):
        # EBNF (GBNF): xgrammar needs a `root` rule.
        if not any(re.match(r"root\s*::=", line) for line in rules):
            raise bad_request("structured_outputs.grammar: an EBNF grammar needs a `root ::= ...` rule", param)
    elif not any(re.match(r"[?!]?start\s*:", line) for line in rules):
        raise bad_request(
            "structured_outputs.grammar must be EBNF with a `root ::= ...` rule or Lark with a `start: ...` rule", param
        )


def _choice_as_grammar(choice: list[str]) -> str:
    """vLLM's `choice_as_grammar`: the engine's xgrammar backend takes choices as EBNF."""
    escapes = {"\\": r"\\", '"': r'\"', "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def escape(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        if ord(ch) < 0x20 or ord(ch) == 0x7F:
            return f"\\u{ord(ch):04x}"
        return ch

    return "root ::= " + " | ".join('"' + "".join(escape(ch) for ch in c) + '"' for c in choice)


def _response_format_overrides(fmt: dict) -> dict[str, Any]:
    """vLLM's `ResponseFormat` → the structured-outputs constraint it sets."""
    kind = fmt.get("type")
    if not isinstance(kind, str):
        raise bad_request("response_format.type must be one of 'text', 'json_object', 'json_schema'", "response_format")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                "When response_format type is 'json_schema', the 'json_schema' field must be an object", "response_format"
            )
        if not isinstance(spec.get("name"), str):
            raise bad_request("response_format.json_schema.name must be a string", "response_format")
        for key in ("description",):
            if spec.get(key) is not None and not isinstance(spec[key], str):
                raise bad_request(f"response_format.json_schema.{key} must be a string", "response_format")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise bad_request("response_format.json_schema.strict must be a boolean", "response_format")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON object", "response_format")
        return {"json": schema}
    if kind in ("structural_tag",):
        raise bad_request("response_format type 'structural_tag' is not supported by this server", "response_format")
    raise bad_request(
        f"unsupported response_format type {kind!r}; use 'text', 'json_object' or 'json_schema'", "response_format"
    )


def structured_outputs(request: SamplingRequestFields) -> StructuredOutputsParams | None:
    """Check `structured_outputs` and `response_format` as vLLM 0.32's front-end does
    (`structured_outputs_from_response_format`, `StructuredOutputsParams.__post_init__`,
    `SamplingParams._validate_structured_outputs`, `validate_xgrammar_grammar`) and build the
    engine's parameters, backend chosen."""
    so: StructuredOutputsRequest | None = request.structured_outputs
    fmt = request.response_format
    fields: dict[str, Any] = {}
    if so is not None:
        fields = {
            "json": so.json_schema, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
            "json_object": so.json_object, "structural_tag": so.structural_tag,
        }
    overrides = _response_format_overrides(fmt) if fmt is not None else {}
    param = "response_format" if overrides else "structured_outputs"
    fields.update(overrides)
    constraints = {k: v for k, v in fields.items() if v is not None}
    if so is None and not constraints:
        return None
    if len(constraints) > 1:
        raise bad_request(
            f"only one kind of structured outputs constraint may be used, got {sorted(constraints)}", param
        )
    if not constraints:
        raise bad_request(
            "structured_outputs needs one of json, regex, choice, grammar, json_object or structural_tag", "structured_outputs"
        )
    if so is not None and so.whitespace_pattern is not None:
        _check_regex(so.whitespace_pattern, "structured_outputs", "structured_outputs.whitespace_pattern")
    (kind, value), = constraints.items()
    params = StructuredOutputsParams(
        disable_any_whitespace=so.disable_any_whitespace if so else False,
        disable_additional_properties=so.disable_additional_properties if so else False,
        whitespace_pattern=so.whitespace_pattern if so else None,
        _backend=STRUCTURED_BACKEND,
        _backend_was_auto=True,
    )
    if kind == "json":
        params.json = check_json_schema(value, param)
    elif kind == "json_object":
        if value is not True:
            raise bad_request("structured_outputs.json_object must be true if set", param)
        params.json_object = True
    elif kind == "regex":
        _check_regex(value, param, "structured_outputs.regex")
        params.regex = value
    elif kind == "choice":
        if not value:
            raise bad_request("structured_outputs.choice cannot be an empty list", param)
        if len(value) > MAX_CHOICES:
            raise bad_request(f"structured_outputs.choice is limited to {MAX_CHOICES} entries", param)
        for choice in value:
            if not choice:
                raise bad_request("structured_outputs.choice cannot contain an empty string", param)
            if len(choice) > MAX_CHOICE_CHARS:
                raise bad_request(f"structured_outputs.choice entries are limited to {MAX_CHOICE_CHARS} characters", param)
        params.grammar = _choice_as_grammar(value)
    elif kind == "grammar":
        _check_grammar(value, param)
        params.grammar = value
    else:
        raise bad_request("structured_outputs.structural_tag is not supported by this server", param)
    return params

"""Structured outputs (`structured_outputs`, `response_format`) checked as vLLM 0.32's front-end does, and the engine's parameters built.

Sizes, nesting and shapes are checked first (cheap, before any parsing), then every JSON schema, regex,
grammar and choice is parsed by the grammar compiler the engine runs (`grammar_check`, xgrammar), as
vLLM's front end has it parsed: what it refuses never reaches an engine. Each refusal is a 400 naming
the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mmserve.wire import StructuredOutputsParams
from mmserve.xgrammar_native import is_lark

from . import grammar_check
from .errors import bad_request
from .protocol import SamplingRequestFields, StructuredOutputsRequest

MAX_JSON_NESTING = 64  # [MAX_STRUCTURED_OUTPUT_JSON_NESTING]
MAX_SCHEMA_CHARS = 256 * 1024
MAX_REGEX_CHARS = 16 * 1024
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096
# The grammar backend mmserve asks engines for: vLLM's "auto" resolves to xgrammar, and an
# engine keeps the backend of its first structured request, so only xgrammar is used.
STRUCTURED_BACKEND = "xgrammar"


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
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            raise bad_request(f"JSON schema at {path}: \"type\" must be a string or a list of strings", param)
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
            if not isinstance(value, list):
                raise bad_request(f"JSON schema at {path}: \"{key}\" must be an array", param)
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
    if "pattern" in node and not isinstance(node["pattern"], str):
        raise bad_request(f"JSON schema at {path}: \"pattern\" must be a string", param)
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
    check_with_compiler(grammar_check.check_json_schema, schema, param, "the JSON schema")
    return spec


def _check_regex(pattern: Any, param: str, what: str) -> None:
    if not isinstance(pattern, str):
        raise bad_request(f"{what} must be a string", param)
    if len(pattern) > MAX_REGEX_CHARS:
        raise bad_request(f"{what} is limited to {MAX_REGEX_CHARS} characters", param)
    if "\x00" in pattern:
        raise bad_request(f"{what} must not contain a NUL character", param)
    check_with_compiler(grammar_check.check_regex, pattern, param, what)


def _check_grammar(grammar: str, param: str) -> None:
    if not grammar.strip():
        raise bad_request("structured_outputs.grammar cannot be an empty string", param)
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"structured_outputs.grammar is limited to {MAX_GRAMMAR_CHARS} characters", param)
    if "\x00" in grammar:
        raise bad_request("structured_outputs.grammar must not contain a NUL character", param)
    lark = is_lark(grammar)
    check_with_compiler(grammar_check.check_lark if lark else grammar_check.check_ebnf, grammar, param,
            f"structured_outputs.grammar ({'Lark' if lark else 'EBNF'})")


def check_with_compiler(check: Callable[[Any], None], spec: Any, param: str, what: str) -> None:
    """The engine's grammar compiler parses `spec` as vLLM's front end has it parse it; a refusal is a
    400 naming the field, with the compiler's reason."""
    try:
        check(spec)
    except grammar_check.GrammarRejected as exc:
        raise bad_request(f"{what} is refused by the grammar compiler (xgrammar): {exc}", param) from None


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
            if len(choice) > MAX_CHOICE_CHARS:
                raise bad_request(f"structured_outputs.choice entries are limited to {MAX_CHOICE_CHARS} characters", param)
        params.grammar = _choice_as_grammar(value)
        check_with_compiler(grammar_check.check_ebnf, params.grammar, param, "structured_outputs.choice (as a grammar)")
    elif kind == "grammar":
        _check_grammar(value, param)
        params.grammar = value
    else:
        raise bad_request("structured_outputs.structural_tag is not supported by this server", param)
    return params

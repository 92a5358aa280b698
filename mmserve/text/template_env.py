"""The sandboxed Jinja environment chat templates run in (transformers' `_compile_jinja_template`),
and vLLM's detection of a template's content format from its AST (renderers/hf.py)."""

from __future__ import annotations

import json
from collections import deque
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .conversation import ContentFormat

# ---------------------------------------------------------------------------
# Jinja environment (transformers' _compile_jinja_template)
# ---------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged
    (transformers only uses it to compute assistant masks)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Unlike Jinja's own tojson: no HTML escaping, non-ASCII kept.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


JINJA_ENV = _make_environment()

# Marker transformers appends to the final message for continue_final_message.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


# ---------------------------------------------------------------------------
# Content-format detection (vLLM renderers/hf.py _detect_content_format)
# ---------------------------------------------------------------------------


def _is_var_access(node: jinja2.nodes.Node, varname: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == varname


def _is_attr_access(node: jinja2.nodes.Node, varname: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_var_access(node.node, varname)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node: jinja2.nodes.Node, varname: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _assigned_aliases(root: jinja2.nodes.Template, varname: str) -> list[str]:
    """``varname`` plus every variable assigned from it (transitively)."""
    names = [varname]
    pending = deque([varname])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems_access(assign.node, current):
                assert isinstance(assign.target, jinja2.nodes.Name)
                names.append(assign.target.name)
                if assign.target.name != current:
                    pending.append(assign.target.name)
    return names


def _message_loop_targets(root: jinja2.nodes.Template) -> list[str]:
    """Names bound by ``{% for message in messages %}``-style loops."""
    aliases = _assigned_aliases(root, "messages")
    targets = []
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems_access(loop.iter, name) for name in aliases):
            assert isinstance(loop.target, jinja2.nodes.Name)
            targets.append(loop.target.name)
    return targets


def _has_content_loop(root: jinja2.nodes.Template) -> bool:
    """Whether the template iterates over a message's content (directly, via a
    macro parameter bound to ``message.content``, or a top-level ``content``)."""
    message_vars = _message_loop_targets(root)

    def is_content_of_message(node: jinja2.nodes.Node) -> bool:
        return any(_is_var_or_elems_access(node, var, "content") for var in message_vars)

    macro_content_params: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and is_content_of_message(arg):
                        content_params.add(macro.args[i].name)
                for kwarg in call.kwargs:
                    if kwarg.key in param_names and is_content_of_message(kwarg.value):
                        content_params.add(kwarg.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                macro_content_params[id(loop)] = content_params

    for loop in root.find_all(jinja2.nodes.For):
        if is_content_of_message(loop.iter):
            return True
        params = macro_content_params.get(id(loop))
        if isinstance(loop.iter, jinja2.nodes.Name):
            if params is not None and loop.iter.name in params:
                return True
            if id(loop) not in loops_in_macros and loop.iter.name == "content":
                return True
    return False


@lru_cache(maxsize=32)
def detect_content_format(template: str) -> ContentFormat:
    """"openai" if the template loops over message content, else "string"
    (vLLM's ``--chat-template-content-format auto``)."""
    try:
        ast = JINJA_ENV.parse(template)
        return "openai" if _has_content_loop(ast) else "string"
    except Exception:
        return "string"

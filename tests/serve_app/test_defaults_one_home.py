"""`serve_app/config.py` is the one home of every default: written anywhere else, a default drifts
(the built-in engine's sizes, the cache's 4.0 / lru, the back-off and the limits were each written
two or three times, and nothing compared them).

Two checks: the settings the application hands its parts have no defaults of their own, and nothing
named like a config key has a default in the production packages.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from serve_app import settings as app_settings
from serve_app.config import AppConfig

REPO = Path(__file__).resolve().parents[2]
PRODUCTION = ("mmserve", "deployments", "serve_app")
CONFIG_FILE = REPO / "serve_app" / "config.py"

# Fields of settings dataclasses that hold a default although they are reached from the config:
# each is something the config does not set (and must not), with the reason.
NOT_CONFIGURABLE = {
    ("FetchPolicy", "allowed_url_schemes"): "what the fetch code can read; tests narrow it",
    ("FetchPolicy", "user_agent"): "how the gateway names itself to image hosts",
    ("EngineAddresses", "inputs"): "None: a random port on the handshake host (EngineEndpoint passes it always)",
    ("EngineAddresses", "outputs"): "None: a random port on the handshake host (EngineEndpoint passes it always)",
}

# Names of config keys that also name something else in the packages ("path:name": what it is).
SAME_NAME_OTHER_MEANING = {
    "mmserve/wire/handshake.py:max_num_seqs": "vLLM's EngineCoreReadyResponse field, its default on the wire",
}


def _settings_objects(config: AppConfig) -> list[Any]:
    endpoint = config.engine_endpoints()[0]
    return [
        app_settings.serving_settings(config),
        app_settings.engine_client_settings(config, endpoint),
        app_settings.preprocessor_settings(config),
        app_settings.preprocessor_scaling(config),
    ]


def _dataclass_types(value: Any, seen: dict[type, None]) -> dict[type, None]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        seen.setdefault(type(value))
        for field in dataclasses.fields(value):
            _dataclass_types(getattr(value, field.name), seen)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _dataclass_types(item, seen)
    return seen


def test_settings_made_from_the_config_have_no_defaults_of_their_own():
    launch = AppConfig.model_validate({"model": str(REPO), "engine_launch": {}})
    types: dict[type, None] = {}
    for config in (AppConfig(), launch):
        for settings in _settings_objects(config):
            _dataclass_types(settings, types)
    assert len(types) >= 10, sorted(t.__name__ for t in types)  # the walk reached the nested settings
    with_defaults = [
        f"{cls.__module__}.{cls.__name__}.{field.name}"
        for cls in types
        for field in dataclasses.fields(cls)
        if field.init
        and (field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING)
        and (cls.__name__, field.name) not in NOT_CONFIGURABLE
    ]
    assert not with_defaults, f"defaults outside serve_app/config.py: {with_defaults}"


def _config_defaults(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    """Every leaf default of the config, by dotted key."""
    found: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        nested = [t for t in (getattr(annotation, "__args__", None) or (annotation,)) if isinstance(t, type) and issubclass(t, BaseModel)]
        if nested:
            found.update(_config_defaults(nested[0], f"{prefix}{name}."))
        elif not field.is_required():
            found[prefix + name] = field.get_default(call_default_factory=True)
    return found


def _literal(node: ast.AST | None) -> Any:
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except ValueError:
        try:  # 4 * 1024 * 1024 and the like
            return eval(compile(ast.Expression(node), "<default>", "eval"), {"__builtins__": {}})
        except Exception:
            return None


def _written_defaults(tree: ast.AST) -> list[tuple[int, str, Any]]:
    """(line, name, value) of every default in a module: dataclass fields, parameters, argparse flags."""
    found: list[tuple[int, str, Any]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                if isinstance(statement, ast.AnnAssign) and statement.value is not None and isinstance(statement.target, ast.Name):
                    found.append((statement.lineno, statement.target.id, _literal(statement.value)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            positional = arguments.posonlyargs + arguments.args
            for arg, default in zip(positional[len(positional) - len(arguments.defaults):], arguments.defaults):
                found.append((default.lineno, arg.arg, _literal(default)))
            for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults):
                if default is not None:
                    found.append((default.lineno, arg.arg, _literal(default)))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flag = next((_literal(a) for a in node.args if isinstance(_literal(a), str)), "?")
            for keyword in node.keywords:
                if keyword.arg == "default":
                    found.append((keyword.value.lineno, flag, _literal(keyword.value)))
    return found


def test_no_config_default_is_written_again_in_the_packages():
    """A parameter, field or command-line flag named like a config key has no default below `serve_app`
    (None, "not given", aside): its value comes from the config."""
    defaults = _config_defaults(AppConfig)
    assert {"builtin_engine.max_model_len", "limits.max_request_bytes", "images.cache_bytes", "routing.max_imbalance"} <= set(defaults)
    keys_by_name = {key.rsplit(".", 1)[-1]: key for key in defaults}
    again = []
    for package in PRODUCTION:
        for path in sorted((REPO / package).rglob("*.py")):
            if path == CONFIG_FILE:
                continue
            for line, name, value in _written_defaults(ast.parse(path.read_text(), str(path))):
                key = keys_by_name.get(name.lstrip("-").replace("-", "_"))
                if key and value is not None and f"{path.relative_to(REPO)}:{name}" not in SAME_NAME_OTHER_MEANING:
                    again.append(f"{path.relative_to(REPO)}:{line} {name} = {value!r} (the config's {key} = {defaults[key]!r})")
    assert not again, "config defaults written again below serve_app:\n" + "\n".join(again)

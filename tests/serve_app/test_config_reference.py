"""The configuration reference, `docs/configuration.md`, is generated from the config schema: every setting
has its description there, once, and the committed reference is what the schema gives."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from pydantic import BaseModel

from serve_app.config import AppConfig

REPO = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _models(model: type[BaseModel], seen: set) -> set:
    seen.add(model)
    for field in model.model_fields.values():
        for arg in (field.annotation, *getattr(field.annotation, "__args__", ())):
            for inner in (arg, *getattr(arg, "__args__", ())):
                if isinstance(inner, type) and issubclass(inner, BaseModel) and inner not in seen:
                    _models(inner, seen)
    return seen


def test_every_setting_has_a_description_and_a_row():
    reference = (REPO / "docs" / "configuration.md").read_text()
    for model in _models(AppConfig, set()):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            assert f"{name}` |" in reference, f"{model.__name__}.{name} is not in docs/configuration.md"


def test_the_committed_reference_is_the_schemas():
    generated = _generator().reference()
    committed = (REPO / "docs" / "configuration.md").read_text()
    if generated != committed:
        pytest.fail("docs/configuration.md differs from serve_app/config.py: run .venv/bin/python scripts/config_reference.py")

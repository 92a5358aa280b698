"""Write docs/configuration.md from the application's config schema (`serve_app/config.py`): every setting's
name, type, default and description, as the schema holds them.

    .venv/bin/python scripts/config_reference.py          # rewrite docs/configuration.md
    .venv/bin/python scripts/config_reference.py --check  # exit 1 if it differs from the schema's
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from serve_app.config import AppConfig  # noqa: E402

OUTPUT = REPO / "docs" / "configuration.md"

HEADER = """# Configuration

The arguments of `serve_app:build_app` (and of `serve_app:build_engine_app`, one engine each). Give them
on the command line, `serve run serve_app:build_app key=value ...` (JSON for lists and nested objects:
`limits='{"max_n": 4}'`), or in `applications[].args` of a Serve config file (`cluster/`). Every limit is
enforced before the work it protects; what a refusal means is in README's "Operations" (its refusal table).

Generated from `serve_app/config.py` by `scripts/config_reference.py`: edit the descriptions there.
"""


def _type(annotation: object) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " or ".join(f"`{value}`" for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        named = [_type(arg) for arg in args if arg is not type(None)]
        return " or ".join(named) + (" or none" if type(None) in args else "")
    if origin in (list, dict):
        return f"{origin.__name__} of " + ", ".join(_type(arg) for arg in typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    return getattr(annotation, "__name__", str(annotation))


def _default(name: str, field: FieldInfo) -> str:
    if field.default_factory is not None:
        return "(below)"
    value = field.default
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and name.endswith("_bytes") and value >= 1024 and value % 1024 == 0:
        return f"{value // 1024**2} MiB" if value % 1024**2 == 0 else f"{value // 1024} KiB"
    if isinstance(value, (list, dict)):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows, nested = [], []
    for name, field in model.model_fields.items():
        if field.description is None:
            raise ValueError(f"{model.__name__}.{name} has no description")
        rows.append(f"| `{prefix}{name}` | {_type(field.annotation)} | {_default(name, field)} | {field.description} |")
        for arg in (field.annotation, *typing.get_args(field.annotation), *(a for t in typing.get_args(field.annotation) for a in typing.get_args(t))):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                nested.append((f"{prefix}{name}" + ("[]" if typing.get_origin(field.annotation) is not None and "list" in str(field.annotation) else ""), arg))
                break
    sections = ["| setting | type | default | meaning |", "|---|---|---|---|", *rows]
    for path, inner in nested:
        sections += ["", f"### `{path}`", "", (inner.__doc__ or "").strip().split("\n\n")[0].replace("\n", " "), "", *_rows(inner, f"{path}.")]
    return sections


def reference() -> str:
    return HEADER + "\n## The application\n\n" + "\n".join(_rows(AppConfig, "")) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md differs from the schema's")
    args = parser.parse_args()
    text = reference()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            sys.exit(f"{OUTPUT.relative_to(REPO)} differs from serve_app/config.py: run scripts/config_reference.py")
        return
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text(text)


if __name__ == "__main__":
    main()

"""The config tree, written out for people: docs/configuration.md and `grpoflow config show`.

Both walk `GRPOConfig` itself (its fields, their annotations and descriptions, recursively), so where
the section models live does not matter and a new field shows up without touching this file.
docs/configuration.md is `render_markdown()`; a unit test fails when the two differ
(regenerate with `grpoflow config docs --write`).
"""

from __future__ import annotations

import json
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticUndefined

from grpoflow.flows.config import GRPOConfig

DOCS_PATH = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The model class of a section field (`ModelConfig`), an optional one (`LoraConfig | None`) or a
    list-of-sections field (`list[RewardConfig]`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # an optional section
        subs = [a for a in typing.get_args(annotation) if a is not type(None)]
        return section_model(subs[0]) if len(subs) == 1 else None
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation) or (None,)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item
    return None


def sections(
    model: type[BaseModel] = GRPOConfig, prefix: str = ""
) -> list[tuple[str, type[BaseModel], FieldInfo | None]]:
    """(dotted name, model class, field that holds it) of `model` and every section below it, in field
    order; a list of sections is named `rewards[]`."""
    out: list[tuple[str, type[BaseModel], FieldInfo | None]] = []
    if not prefix:
        out.append(("", model, None))
    for name, field in model.model_fields.items():
        sub = section_model(field.annotation)
        if sub is None:
            continue
        many = typing.get_origin(field.annotation) is list
        dotted = f"{prefix}{name}{'[]' if many else ''}"
        out.append((dotted, sub, field))
        out.extend(sections(sub, dotted + "."))
    return out


# --- Markdown ---------------------------------------------------------------------------------------


def render_markdown() -> str:
    """docs/configuration.md: one table per section (field, type, default, description)."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from the pydantic models by `grpoflow config docs --write` (flows/config_docs.py);",
        "     do not edit by hand: tests/unit/test_config_docs.py fails when this file is stale. -->",
        "",
        "A run's config is one YAML file (e.g. `configs/tiny-letters.yaml`) plus `--set key.sub=value`",
        "overrides; every field has a default. `grpoflow config show CONFIG` prints a config with all",
        "defaults filled in and each field's description as a comment; `grpoflow config schema` prints the",
        "JSON schema (the form of the `grpo-train` deployment in the Prefect UI).",
        "",
        "Relative paths (`data.path`, `model.path`) are looked up in the current directory, then beside",
        "the config file.",
        "",
    ]
    for dotted, model, field in sections():
        title = f"`{dotted}`" if dotted else "Top level"
        lines += [f"## {title}", ""]
        about = field.description if field is not None else _own_doc(model)
        if about:
            lines += [_cell(about, table=False), ""]
        if dotted.endswith("[]"):
            lines += [f"A list; each item has these fields ({model.__name__}).", ""]
        lines += ["| Field | Type | Default | Description |", "| --- | --- | --- | --- |"]
        for name, f in model.model_fields.items():
            sub = section_model(f.annotation)
            desc = _cell(f.description or "")
            if sub is not None:
                many = typing.get_origin(f.annotation) is list
                anchor = f"{dotted}.{name}" if dotted else name
                desc = f"{desc} See [`{anchor}{'[]' if many else ''}`](#{_anchor(anchor, many)})."
            lines.append(f"| `{name}` | {_cell(type_name(f))} | {_cell(default_text(f))} | {desc} |")
        lines.append("")
        for name, f in model.model_fields.items():
            lines += _choice_lines(name, f)
    return "\n".join(lines)


def _choice_lines(name: str, field: FieldInfo) -> list[str]:
    """A field's choices, a line each, where the field documents them (`json_schema_extra` choices)."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    choices = extra.get("choices") or {}
    if not choices:
        return []
    return [f"`{name}`:", ""] + [f"- `{k}`: {_cell(v, table=False)}" for k, v in choices.items()] + [""]


def _own_doc(model: type[BaseModel]) -> str | None:
    doc = model.__dict__.get("__doc__")
    return " ".join(doc.split()) if doc else None


def _anchor(dotted: str, many: bool) -> str:
    # GitHub's heading anchors: lowercase, punctuation other than '-' and '_' dropped.
    text = f"{dotted}{'[]' if many else ''}".lower()
    return "".join(ch for ch in text if ch.isalnum() or ch in "-_")


def _cell(text: str, table: bool = True) -> str:
    text = " ".join(str(text).split())
    return text.replace("|", "\\|") if table else text


def type_name(field: FieldInfo) -> str:
    """The field's type as a YAML user sees it, constraints included: `int >= 1`, `"grpo" | "dapo"`.
    Alternatives only Python can give (a callable instead of an import path) are left out."""
    text = _type_text(field.annotation)
    bounds = []
    for m in field.metadata:
        for cls, op, attr in (
            (annotated_types.Ge, ">=", "ge"),
            (annotated_types.Gt, ">", "gt"),
            (annotated_types.Le, "<=", "le"),
            (annotated_types.Lt, "<", "lt"),
        ):
            if isinstance(m, cls):
                bounds.append(f"{op} {getattr(m, attr)}")
        if isinstance(m, annotated_types.MinLen):
            bounds.append(f"at least {m.min_length}" if "list" in text else f"length >= {m.min_length}")
    return f"`{text}` {', '.join(bounds)}".strip() if bounds else f"`{text}`"


def _type_text(ann: Any) -> str:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is type(None):
        return "null"
    if ann is Any:
        return "any"
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in args if not _python_only(a))
    if origin is list:
        return f"list[{_type_text(args[0])}]" if args else "list"
    if origin is dict:
        return f"dict[{_type_text(args[0])}, {_type_text(args[1])}]" if args else "dict"
    if origin is typing.Annotated:
        return _type_text(args[0])
    if isinstance(ann, type):
        return {"str": "string", "int": "int", "float": "float", "bool": "bool"}.get(
            ann.__name__, ann.__name__
        )
    return str(ann)


def _python_only(ann: Any) -> bool:
    return typing.get_origin(ann) is typing.Annotated and any(
        isinstance(m, SkipJsonSchema) for m in getattr(ann, "__metadata__", ())
    )


def default_text(field: FieldInfo) -> str:
    if field.default_factory is None and field.default is PydanticUndefined:
        return "required"
    if field.exclude:  # a secret: its default comes from the environment, never printed
        return "from the environment"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{_flow_yaml(_plain(value))}`"


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_defaults=True)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


# --- YAML with comments -----------------------------------------------------------------------------


def render_yaml(cfg: GRPOConfig, width: int = 100) -> str:
    """`cfg` as YAML, every field preceded by its description as a comment. `yaml.safe_load` of the
    text gives `cfg.model_dump()` back."""
    return "\n".join(_mapping_lines(cfg, 0, width)) + "\n"


def _comment(text: str | None, indent: int, width: int) -> list[str]:
    if not text:
        return []
    pad = " " * indent
    return textwrap.wrap(
        " ".join(text.split()),
        max(40, width - indent - 2),
        initial_indent=pad + "# ",
        subsequent_indent=pad + "# ",
    )


def _mapping_lines(obj: BaseModel, indent: int, width: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    for name, field in type(obj).model_fields.items():
        value = getattr(obj, name)
        if indent == 0 and lines:
            lines.append("")  # a blank line between top-level sections
        if field.exclude:  # a secret (inference.api_key): named in a comment, its value never shown
            lines += _comment(f"{name} (not shown): {field.description}", indent, width)
            continue
        lines += _comment(field.description, indent, width)
        if isinstance(value, BaseModel):
            lines.append(f"{pad}{name}:")
            lines += _mapping_lines(value, indent + 2, width)
        elif isinstance(value, list) and value and all(isinstance(v, BaseModel) for v in value):
            lines.append(f"{pad}{name}:")
            for item in value:
                lines.append(f"{pad}  -")
                lines += _mapping_lines(item, indent + 4, width)
        else:
            lines.append(f"{pad}{name}: {_flow_yaml(_plain_value(value))}")
    return lines


def _plain_value(value: Any) -> Any:
    if callable(value) and not isinstance(value, type | str):  # given from Python: show its import path
        return f"{getattr(value, '__module__', '?')}:{getattr(value, '__qualname__', repr(value))}"
    if isinstance(value, list):
        return [_plain_value(v) for v in value]
    if isinstance(value, BaseModel):
        return value.model_dump()
    return value


def _flow_yaml(value: Any) -> str:
    """One line of YAML for a leaf value (flow style for lists and mappings)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, allow_unicode=True, sort_keys=False)
    text = text.removesuffix("\n").removesuffix("\n...")
    if "\n" in text:  # a string with line breaks: JSON's double-quoted form is valid YAML too
        return json.dumps(value)
    return text

"""docs/configuration.md is generated from the config tree and kept in step with it."""

from __future__ import annotations

import pytest

from grpoflow.flows.config import GRPOConfig
from grpoflow.flows.config_docs import DOCS_PATH, render_markdown, sections

pytestmark = pytest.mark.unit


def test_docs_configuration_md_is_up_to_date():
    assert DOCS_PATH.is_file() and DOCS_PATH.read_text() == render_markdown(), (
        "docs/configuration.md is stale: run `grpoflow config docs --write`"
    )


def test_every_section_and_field_is_documented():
    text = render_markdown()
    names = [dotted for dotted, _, _ in sections()]
    assert names[0] == "" and set(GRPOConfig.model_fields) <= {n.removesuffix("[]") for n in names}
    for dotted, model, _ in sections():
        assert f"## `{dotted}`" in text or not dotted
        for name, field in model.model_fields.items():
            assert field.description, f"{dotted or 'GRPOConfig'}.{name} has no description"
            assert f"| `{name}` |" in text

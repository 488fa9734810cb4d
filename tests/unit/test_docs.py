"""Docs that are generated must be current."""

from __future__ import annotations

from paths import ROOT

from cascade_ray.config.reference import render


def test_config_reference_is_generated_from_the_schema():
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == render(), "docs/config.md is stale: python -m cascade_ray.config.reference > docs/config.md"


def test_every_schema_field_is_documented():
    import re

    undocumented = re.findall(r"^\| `([^`]+)` \| [^|]+(?:\\\|[^|]+)* \| [^|]+ \|  \|$", render(), flags=re.M)
    assert not undocumented


def test_the_space_file_reference_is_generated_from_its_model():
    from cascade_ray.tune.reference import render as render_spaces

    committed = (ROOT / "docs" / "tune_spaces.md").read_text()
    assert committed == render_spaces(), (
        "docs/tune_spaces.md is stale: python -m cascade_ray.tune.reference > docs/tune_spaces.md"
    )
    assert "| `space.<key>.loguniform` |" in committed and "| `scheduler.type` |" in committed

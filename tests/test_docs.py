"""The generated CLI reference must match the code."""

from pathlib import Path

from dspark_core.config import config_fields
from dspark_core.docgen import render

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_cli_reference_is_fresh():
    committed = (DOCS / "cli.md").read_text(encoding="utf-8")
    assert committed == render(), "docs/cli.md is stale: run `make docs` (python -m dspark_core.docgen > docs/cli.md)"


def test_cli_reference_documents_every_flag():
    text = render()
    for attribute in config_fields():
        assert f"`--{attribute.name}`" in text

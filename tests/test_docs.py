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


def test_calibration_doc_shows_the_shipped_demo_file():
    import json
    import re

    text = (DOCS / "calibration.md").read_text(encoding="utf-8")
    shipped = Path(__file__).resolve().parents[1] / "dspark_core" / "configs" / "demo-calibration.json"
    blocks = [json.loads(b) for b in re.findall(r"```json\n(.*?)```", text, flags=re.S)]
    assert json.loads(shipped.read_text(encoding="utf-8")) in blocks, \
        "docs/calibration.md no longer shows configs/demo-calibration.json"

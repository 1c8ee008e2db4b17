"""docs/cost-tables.md shows a real, canonical bundle."""

from __future__ import annotations

import re
from pathlib import Path

from dspark_core.table import dumps_table, loads_table
from test_costs_support import LOOKUP

DOC = Path(__file__).resolve().parent.parent / "docs" / "cost-tables.md"


def test_documented_bundle_loads_and_is_written_exactly_as_shown():
    block = re.search(r"```json\n(.*?)```", DOC.read_text(), re.S)
    assert block, "docs/cost-tables.md lost its bundle example"
    table = loads_table(block.group(1), LOOKUP, "docs example")
    assert table.draft_width == 5 and table.model == "additive" and table.is_bundle
    assert dumps_table(table) == block.group(1)

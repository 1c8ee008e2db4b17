"""Figures the docs state about shipped artifacts must match the artifacts."""

from __future__ import annotations

import json
import re
from pathlib import Path

from dspark_core.models.drafts import default_draft_path

DOCS = Path(__file__).resolve().parents[1] / "docs"
# every place docs/draft-training.md states the shipped draft's vocabulary size
VOCAB_CLAIMS = [r"proposes from the (\d+ \d{3}) tokens", r"\| draft vocabulary \| (\d+ \d{3}) of",
                r"draft vocabulary (\d+ \d{3}),"]


def test_draft_training_doc_states_the_shipped_draft_vocabulary():
    config = json.loads((Path(default_draft_path("smollm2")) / "config.json").read_text())
    text = (DOCS / "draft-training.md").read_text(encoding="utf-8")
    for pattern in VOCAB_CLAIMS:
        found = re.findall(pattern, text)
        assert found, pattern
        assert {int(n.replace(" ", "")) for n in found} == {config["draft_vocab_size"]}, pattern

"""The strict JSON converter: unknown keys and wrong types name their JSON path."""

from __future__ import annotations

import json

import pytest
from attrs import frozen

from dspark_core.convert import load_json_file, structure_strict
from dspark_core.errors import ConfigError


@frozen
class Interval:
    prefill_tokens: int
    max_kv_length: int


@frozen
class Settings:
    model: str
    contexts: tuple[Interval, ...] = ()
    ratio: float = 1.0
    enabled: bool = True


def test_valid_data_structures():
    s = structure_strict({"model": "sps", "contexts": [{"prefill_tokens": 1, "max_kv_length": 2}], "ratio": 2},
                         Settings)
    assert s == Settings("sps", (Interval(1, 2),), 2.0)


@pytest.mark.parametrize("data,fragment", [
    ({"model": "a", "contexts": [{"prefill_tokens": 1, "max_kv_length": "x"}]}, "$.contexts[0].max_kv_length"),
    ({"model": "a", "bogus": 1}, "unknown key(s) (bogus) @ $"),
    ({"model": "a", "contexts": [{"prefill_tokens": 1, "max_kv_length": 2, "zz": 3}]}, "(zz) @ $.contexts[0]"),
    ({"model": 3}, "@ $.model"),
    ({"model": "a", "contexts": [{"prefill_tokens": True, "max_kv_length": 2}]}, "$.contexts[0].prefill_tokens"),
    ({"model": "a", "contexts": [{"prefill_tokens": 1.5, "max_kv_length": 2}]}, "$.contexts[0].prefill_tokens"),
    ({"model": "a", "enabled": 1}, "$.enabled"),
    ({}, "$.model"),
])
def test_errors_name_the_json_path(data, fragment):
    with pytest.raises(ConfigError) as info:
        structure_strict(data, Settings, source="cal.json")
    assert fragment in str(info.value) and str(info.value).startswith("cal.json: ")


def test_non_object_top_level():
    with pytest.raises(ConfigError, match=r"expected a JSON object at \$, got list"):
        structure_strict([1], Settings)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_json_file(tmp_path / "missing.json", Settings)
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "a",')
    with pytest.raises(ConfigError, match=r"not valid JSON \(line 1"):
        load_json_file(bad, Settings)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"model": "a"}))
    assert load_json_file(good, Settings).model == "a"

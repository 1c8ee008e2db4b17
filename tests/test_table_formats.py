"""The other accepted inputs: bare tables and the two legacy formats (width 7)."""

from __future__ import annotations

import json

import pytest

from dspark_core.errors import TableError
from dspark_core.table import check_compatible, dumps_table, fit_table, load_table, loads_table, save_table
from test_costs_support import LOOKUP, fingerprint, grid_samples, settings, simple_cost

LEGACY_SPS = {"sample_batch_tokens": [1, 8, 16, 32], "sample_steps_per_sec": [90.0, 80.0, 60.0, 40.0], "max_batch_tokens": 32}
LEGACY_ADDITIVE = {
    "bias_seconds": 0.01,
    "bs_probes": [1, 2, 4],
    "alpha_seconds": [0.0, 0.001, 0.003],
    "m_probes": [1, 8, 16, 32],
    "theta_seconds": [0.0, 0.002, 0.004, 0.008],
}


def bare_table(model="additive", draft_width=3):
    buckets = (1, 2)
    return fit_table(settings(model, draft_width, buckets), grid_samples(simple_cost, buckets, draft_width), LOOKUP)


@pytest.mark.parametrize("model", ["additive", "sps"])
def test_bare_table_records_its_width_and_round_trips(tmp_path, model):
    table = bare_table(model, 5)
    path = save_table(table, tmp_path / "bare.json")
    data = json.loads(path.read_text())
    assert set(data) == {"model", "draft_width", "params"} and data["draft_width"] == 5
    loaded = load_table(path, LOOKUP)
    assert loaded == table and loaded.origin == "bare" and not loaded.width_assumed
    assert dumps_table(loaded) == path.read_text()
    assert loaded.predict_seconds(2, 7, kv_length=10**6) == pytest.approx(table.fits[0].cost.predict_seconds(2, 7))


def test_bare_table_only_checks_width_and_says_so():
    table = loads_table(dumps_table(bare_table()), LOOKUP, "bare.json")
    note = check_compatible(table, fingerprint(), draft_width=3)
    assert note == (
        "cost table bare.json (bare, draft_width 3) has no compatibility fingerprint: "
        "only its draft width could be checked against this launch"
    )
    with pytest.raises(TableError, match="draft_width: saved 3, launch 5"):
        check_compatible(table, fingerprint(), draft_width=5)


def test_legacy_sps_table_is_width_seven():
    table = loads_table(json.dumps(LEGACY_SPS), LOOKUP, "old.json")
    assert table.draft_width == 7 and table.model == "sps" and table.origin == "legacy sps" and table.width_assumed
    assert table.predict_seconds(1, 8, kv_length=1) == pytest.approx(1 / 80.0)
    assert table.predict_seconds(4, 24, kv_length=99999) == pytest.approx(1 / 50.0)
    assert table.predict_seconds(4, 33, kv_length=1) is None  # above max_batch_tokens
    assert "no draft_width field, treated as 7" in table.audit_note()
    with pytest.raises(TableError, match="draft_width: saved 7, launch 5"):
        check_compatible(table, None, draft_width=5)
    assert check_compatible(table, None, draft_width=7) == table.audit_note()


def test_legacy_additive_table_is_width_seven():
    table = loads_table(json.dumps(LEGACY_ADDITIVE), LOOKUP, "old.json")
    assert table.draft_width == 7 and table.model == "additive" and table.origin == "legacy additive"
    # bias + alpha(2) + theta interpolated halfway between 8 and 16 rows.
    assert table.predict_seconds(2, 12, kv_length=5) == pytest.approx(0.01 + 0.001 + 0.003)
    assert table.predict_seconds(8, 12, kv_length=5) is None  # bucket never probed


def test_legacy_file_with_a_width_keeps_it():
    table = loads_table(json.dumps(dict(LEGACY_ADDITIVE, draft_width=5)), LOOKUP, "old.json")
    assert table.draft_width == 5 and not table.width_assumed


def test_legacy_table_is_resaved_as_a_bare_table_with_its_width():
    table = loads_table(json.dumps(LEGACY_SPS), LOOKUP, "old.json")
    data = json.loads(dumps_table(table))
    assert data["draft_width"] == 7 and data["model"] == "sps" and data["params"]["max_rows"] == 32
    assert loads_table(json.dumps(data), LOOKUP) == table


def test_bare_table_without_width_is_treated_as_seven():
    data = json.loads(dumps_table(bare_table(draft_width=7)))
    del data["draft_width"]
    table = loads_table(json.dumps(data), LOOKUP, "b.json")
    assert table.draft_width == 7 and table.origin == "legacy bare" and table.width_assumed


def test_unrecognised_object_lists_the_accepted_formats():
    with pytest.raises(TableError) as err:
        loads_table(json.dumps({"costs": [1, 2]}), LOOKUP, "what.json")
    text = str(err.value)
    assert "what.json: not a cost table (found keys: costs)" in text
    for fragment in ("versioned bundle", "bare table", "sample_batch_tokens", "bias_seconds, bs_probes"):
        assert fragment in text


def test_non_object_json_lists_the_accepted_formats():
    with pytest.raises(TableError, match=r"expected a JSON object at \$; accepted formats: versioned bundle"):
        loads_table("[1, 2, 3]", LOOKUP, "list.json")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (dict(LEGACY_SPS, extra=1), r"unknown key\(s\) \(extra\) @ \$"),
        (dict(LEGACY_SPS, sample_batch_tokens=[1, "8", 16, 32]), r"@ \$.sample_batch_tokens\[1\]"),
        (dict(LEGACY_ADDITIVE, alpha_seconds=[0.0]), "alpha_seconds needs one value per request bucket"),
        ({k: v for k, v in LEGACY_ADDITIVE.items() if k != "m_probes"}, r"m_probes"),
    ],
)
def test_malformed_legacy_files_are_refused(data, message):
    with pytest.raises(TableError, match=message):
        loads_table(json.dumps(data), LOOKUP, "old.json")

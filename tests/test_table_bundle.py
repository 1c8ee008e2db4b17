"""The versioned cost-table bundle: fitting per interval, exact round trips, safe writes, strict loads."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from dspark_core.calibration import ContextInterval
from dspark_core.costs import CostSample
from dspark_core.errors import ConfigError, TableError
from dspark_core.table import check_output_path, dumps_table, fit_table, load_table, loads_table, save_table
from test_costs_support import LOOKUP, fingerprint, grid_samples, settings, simple_cost

SHORT = ContextInterval(64, 1, 512)
LONG = ContextInterval(2048, 513, 4096)


def two_interval_table(model="additive", scale=1.0):
    samples = grid_samples(lambda b, g: scale * simple_cost(b, g), (1, 2, 4), 3, context=0)
    samples += grid_samples(lambda b, g: 2 * scale * simple_cost(b, g), (1, 2, 4), 3, context=LONG)
    return fit_table(settings(model, contexts=(SHORT, LONG)), samples, LOOKUP, fingerprint())


@hsettings(max_examples=20, deadline=None)
@given(st.sampled_from(["additive", "sps"]), st.floats(0.01, 100.0))
def test_bundle_round_trips_bit_for_bit(model, scale):
    table = two_interval_table(model, scale)
    text = dumps_table(table)
    again = loads_table(text, LOOKUP)
    assert again == table
    assert dumps_table(again) == text


def test_save_then_load_gives_an_equal_table(tmp_path):
    table = two_interval_table()
    path = save_table(table, tmp_path / "costs.json")
    loaded = load_table(path, LOOKUP)
    assert loaded == table and loaded.origin == "bundle" and loaded.source == str(path)
    assert path.read_text() == dumps_table(table)
    assert os.listdir(tmp_path) == ["costs.json"]  # the temporary file is gone


def test_each_interval_gets_its_own_fit():
    table = two_interval_table()
    assert table.predict_seconds(2, 5, kv_length=100) == pytest.approx(simple_cost(2, 5))
    assert table.predict_seconds(2, 5, kv_length=1000) == pytest.approx(2 * simple_cost(2, 5))
    assert table.predict_seconds(2, 5, kv_length=5000) is None  # no interval: full-width fallback
    assert table.predict_seconds(8, 9, kv_length=100) is None  # bucket not calibrated


def test_bundle_records_settings_fingerprint_provenance_and_measurements():
    data = json.loads(dumps_table(two_interval_table()))
    assert data["schema_version"] == 1 and data["draft_width"] == 3 and data["model"] == "additive"
    assert set(data) == {"schema_version", "draft_width", "model", "fits", "calibration", "fingerprint", "provenance"}
    assert data["fingerprint"]["execution"]["geometry"]["draft_width"] == 3
    assert data["provenance"]["dspark_core_version"]
    first = data["fits"][0]
    assert first["coverage"]["spans"][0] == {"request_bucket": 1, "min_rows": 1, "max_rows": 4}
    assert {"request_bucket": 2, "target_rows": 8, "step_seconds": pytest.approx(simple_cost(2, 8)), "windows": 3,
            "draft_off": False} in first["measurements"]


def test_samples_for_an_unknown_interval_are_refused():
    samples = grid_samples(simple_cost, (1, 2), 3, context=3)
    with pytest.raises(ConfigError, match="context index 3; the settings list 1 interval"):
        fit_table(settings(buckets=(1, 2)), samples, LOOKUP, fingerprint(buckets=(1, 2)))


def test_fit_errors_name_the_interval():
    samples = grid_samples(simple_cost, (1, 2), 3, rows={1: (4,), 2: (8,)}.get)
    with pytest.raises(ConfigError, match=r"contexts\[0\] KV 1-256 \(prefill 64\): additive: the probe grid is not connected"):
        fit_table(settings(buckets=(1, 2)), samples, LOOKUP, fingerprint(buckets=(1, 2)))


def test_interval_without_samples_is_refused():
    samples = grid_samples(simple_cost, (1, 2, 4), 3, context=0)
    with pytest.raises(ConfigError, match=r"contexts\[1\] KV 513-4096 \(prefill 2048\): no calibration samples"):
        fit_table(settings(contexts=(SHORT, LONG)), samples, LOOKUP, fingerprint())


def test_existing_output_path_is_refused_before_any_work(tmp_path):
    existing = tmp_path / "costs.json"
    existing.write_text("keep me")
    with pytest.raises(TableError, match="already exists; choose a new file"):
        check_output_path(existing)
    with pytest.raises(TableError, match="already exists"):
        save_table(two_interval_table(), existing)
    assert existing.read_text() == "keep me"


def test_missing_output_directory_is_refused(tmp_path):
    with pytest.raises(TableError, match=r"directory .*nowhere does not exist; create it before launch"):
        check_output_path(tmp_path / "nowhere" / "costs.json")


@pytest.mark.parametrize("text", ['{"schema_version": 1, "draft_wid', "\x00garbage", ""])
def test_truncated_or_garbage_json_is_a_clear_error(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(TableError, match="not valid JSON, the file may be truncated or corrupt"):
        load_table(path, LOOKUP)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(TableError, match="not found"):
        load_table(tmp_path / "absent.json", LOOKUP)


def _edited(change) -> str:
    data = json.loads(dumps_table(two_interval_table()))
    change(data)
    return json.dumps(data)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(colour="blue"), r"unknown key\(s\) \(colour\) @ \$"),
        (lambda d: d["fits"][1]["context"].update(extra=1), r"unknown key\(s\) \(extra\) @ \$.fits\[1\].context"),
        (lambda d: d["fingerprint"]["execution"].update(dtype=16), r"@ \$.fingerprint.execution.dtype"),
        (lambda d: d["fits"][0]["params"].update(bias_seconds="x"), r"@ \$.fits\[0\].params.bias_seconds"),
        (lambda d: d["fits"][0]["params"].update(speed=1), r"unknown key\(s\) \(speed\) @ \$.fits\[0\].params"),
        (lambda d: d["fits"][0]["coverage"]["spans"].pop(), r"\$.fits\[0\].coverage does not match"),
        (lambda d: d.update(schema_version=2), "schema_version 2 is not supported"),
        (lambda d: d["calibration"].update(draft_width=5), "calibration draft_width 5 differs from the table's 3"),
        (lambda d: d["fits"][1]["context"].update(min_kv_length=200), r"do not list"),
        (lambda d: d.update(model="mystery"), "no cost model named 'mystery'"),
    ],
)
def test_bad_bundles_are_refused_with_their_json_path(change, message):
    with pytest.raises((TableError,), match=message):
        loads_table(_edited(change), LOOKUP, "costs.json")


def test_overlapping_fit_intervals_in_a_file_are_refused():
    def overlap(d):
        for key in ("calibration",):
            d[key]["contexts"][1]["min_kv_length"] = 500
        d["fits"][1]["context"]["min_kv_length"] = 500

    with pytest.raises(TableError, match=r"overlap: contexts\[0\] KV 1-512 \(prefill 64\) and contexts\[1\] KV 500-4096"):
        loads_table(_edited(overlap), LOOKUP, "costs.json")


def test_non_finite_costs_are_not_saved():
    table = fit_table(settings("sps", buckets=(1,)), [CostSample(1, g, 0, 1.0, 10) for g in (1, 2, 3, 4)], LOOKUP, fingerprint())
    broken = LOOKUP("sps").load(dict(table.fits[0].cost.params, steps_per_second=[1.0, float("inf"), 1.0, 1.0]), 3)
    from attrs import evolve

    bad = evolve(table, fits=[evolve(table.fits[0], cost=broken)])
    with pytest.raises(TableError, match="non-finite"):
        dumps_table(bad)

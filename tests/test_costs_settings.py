"""Calibration settings and samples: strict JSON and the overlap rule."""

from __future__ import annotations

import pytest

from dspark_core.calibration import CalibrationSettings, ContextInterval, check_contexts, settings_from_json
from dspark_core.convert import unstructure
from dspark_core.costs import CostSample, pool_samples
from dspark_core.errors import ConfigError

GOOD = {
    "model": "additive",
    "draft_width": 7,
    "request_buckets": [1, 2, 4],
    "contexts": [{"prefill_tokens": 1868, "min_kv_length": 1800, "max_kv_length": 4096}],
    "warmup_steps": 8,
    "window_steps": 32,
    "windows_per_point": 3,
    "token_seed": 1,
    "draft_off": True,
    "probe_order": "interleaved",
}


@pytest.mark.parametrize("rows", [None, [1, 8, 16], {"1": [1, 8], "2": [2, 16], "4": [4, 32]}])
def test_settings_round_trip_with_every_row_form(rows):
    data = dict(GOOD, target_graph_rows=rows)
    parsed = settings_from_json(data)
    assert unstructure(parsed) == data
    assert settings_from_json(unstructure(parsed)) == parsed


def test_settings_saved_before_the_probe_order_existed_read_as_sequential():
    older = {k: v for k, v in GOOD.items() if k != "probe_order"}
    assert settings_from_json(older).probe_order == "sequential"  # how those tables were probed


def test_rows_mapping_is_available_per_bucket():
    parsed = settings_from_json(dict(GOOD, target_graph_rows={"2": [16, 2], "1": [8]}))
    assert parsed.rows_by_bucket() == {1: (8,), 2: (2, 16)}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"surprise": 1}, r"unknown key\(s\) \(surprise\) @ \$"),
        ({"contexts": [{"prefill_tokens": 1, "min_kv_length": 1, "max_kv_length": "big"}]}, r"@ \$.contexts\[0\].max_kv_length"),
        ({"contexts": [{"prefill_tokens": 1, "min_kv_length": 9, "max_kv_length": 4}]}, r"below min_kv_length 9 @ \$.contexts\[0\]"),
        ({"warmup_steps": True}, r"@ \$.warmup_steps"),
        ({"target_graph_rows": {"one": [1]}}, r"bucket key 'one' is not a positive integer @ \$.target_graph_rows"),
        ({"target_graph_rows": {"8": [8]}}, r"buckets \[8\] that are not in request_buckets"),
        ({"window_steps": 0}, "window_steps must be >= 1"),
        ({"probe_order": "shuffled"}, "probe_order must be one of interleaved, sequential, got 'shuffled'"),
    ],
)
def test_bad_settings_name_the_json_path(change, message):
    with pytest.raises(ConfigError, match=message):
        settings_from_json(dict(GOOD, **change))


def test_overlapping_intervals_are_refused_naming_both():
    contexts = [
        {"prefill_tokens": 512, "min_kv_length": 1, "max_kv_length": 2048},
        {"prefill_tokens": 2048, "min_kv_length": 4096, "max_kv_length": 8192},
        {"prefill_tokens": 1024, "min_kv_length": 2000, "max_kv_length": 4000},
    ]
    with pytest.raises(ConfigError) as err:
        settings_from_json(dict(GOOD, contexts=contexts))
    assert "contexts[0] KV 1-2048 (prefill 512) and contexts[2] KV 2000-4000 (prefill 1024)" in str(err.value)


def test_touching_intervals_overlap_but_adjacent_ones_do_not():
    check_contexts([ContextInterval(0, 1, 100), ContextInterval(0, 101, 200)])
    with pytest.raises(ConfigError, match="overlap"):
        check_contexts([ContextInterval(0, 1, 100), ContextInterval(0, 100, 200)])


def test_settings_need_a_context():
    with pytest.raises(ConfigError, match="at least one interval"):
        CalibrationSettings("sps", 5, (1,), (), 0, 1, 1, 1)


def test_samples_are_pooled_per_point():
    pooled = pool_samples([CostSample(1, 2, 0, 1.0, 10), CostSample(1, 2, 0, 2.0, 20), CostSample(1, 1, 0, 1.0, 5)])
    assert [(m.request_bucket, m.target_rows, m.windows) for m in pooled] == [(1, 1, 1), (1, 2, 2)]
    assert pooled[1].step_seconds == pytest.approx(0.1)


def test_empty_sample_window_is_refused():
    with pytest.raises(ConfigError, match="steps >= 1 and seconds > 0"):
        CostSample(1, 1, 0, 0.0, 32)

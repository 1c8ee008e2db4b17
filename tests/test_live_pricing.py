"""A step whose forward leaves out its tier's unused rows is priced by the rows it runs.

The table is fitted on full buckets; an eager verify forwards only the live requests' rows
(``ModelRunner.forwards_live_rows``), so the planner prices it with ``TierCosts.for_live``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_core.engine.costs import TierCosts
from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.records import StepReport
from dspark_core.engine.request import SamplingParams
from dspark_core.geometry import Geometry
from dspark_core.models.random_models import random_draft, random_target, tiny_target_config
from dspark_plugins.graphs.static import EagerStaticBackend
from capture_support import StandInCapturedBackend
from engine_support import draft_off_table, greedy_references, random_prompts

WIDTH = 5
PER_ROW = 0.001  # draft_off_table: a drafted step costs 20 ms + 1 ms per target row


def installed(buckets=(1, 2, 4), model: str = "additive") -> tuple[TierCosts, Geometry]:
    geometry = Geometry.all_tiers(WIDTH, buckets)
    costs = TierCosts(geometry)
    costs.install(draft_off_table(WIDTH, buckets, per_row=PER_ROW, model=model))
    return costs, geometry


def test_a_full_bucket_is_priced_as_the_table():
    costs, _ = installed()
    for bucket in (1, 2, 4):
        tiers, off = costs.for_live(bucket, 100, bucket, bucket * WIDTH)
        np.testing.assert_array_equal(tiers, costs.for_step(bucket, 100))
        assert off == costs.draft_off_for_step(bucket, 100)


def test_rows_left_out_are_taken_off_each_price():
    costs, geometry = installed()
    rows = np.array(geometry.rows_for(4))
    full, off = costs.for_step(4, 100), costs.draft_off_for_step(4, 100)
    # three live requests, each able to verify all five: one anchor fewer on every tier, and the
    # full-width tier's 20 drafted rows hold only 15 spendable ones
    tiers, live_off = costs.for_live(4, 100, 3, 3 * WIDTH)
    forwarded = 3 + np.minimum(rows - 4, 3 * WIDTH)
    np.testing.assert_allclose(full - tiers, (rows - forwarded) * PER_ROW, atol=1e-9)
    # a draft-off step forwards one row per live request: the fit's row term from 3 rows to 4
    assert off - live_off == pytest.approx(costs.for_step(1, 100)[3] - costs.for_step(1, 100)[2], abs=1e-9)
    assert live_off < off
    # caps allowing two drafted rows in all: every tier from 6 rows on forwards the same 5 rows
    capped, _ = costs.for_live(4, 100, 3, 2)
    assert np.ptp(capped[rows >= 6]) == pytest.approx(0.0, abs=1e-12)
    assert capped[rows >= 6][0] == pytest.approx(tiers[rows == 5][0] + PER_ROW, abs=1e-9)


def test_rows_the_fit_cannot_price_keep_the_full_bucket_price():
    costs, _ = installed(buckets=(2, 4))  # no bucket runs a single row: one forwarded row has no price
    full = costs.for_step(2, 100)
    tiers, off = costs.for_live(2, 100, 1, WIDTH)
    assert off == costs.draft_off_for_step(2, 100)  # draft-off forwards one row
    assert tiers[0] == full[0]  # so does the tier without drafted rows
    assert tiers[1] == pytest.approx(full[1] - PER_ROW, abs=1e-9)  # two rows are priced in bucket 2
    # buckets far apart: bucket 1 runs at most 6 rows, so 7 live requests of bucket 8 have no price
    # (sps: additive cannot fit two buckets that share no row count)
    costs, _ = installed(buckets=(1, 8), model="sps")
    tiers, off = costs.for_live(8, 100, 7, 0)
    assert off == costs.draft_off_for_step(8, 100)
    np.testing.assert_array_equal(tiers, costs.for_step(8, 100))


CFG = tiny_target_config(max_position=256)


@pytest.mark.parametrize("backend", [None, "static", "captured"])
def test_the_planner_prices_partial_steps_by_the_rows_the_forward_runs(backend):
    """Three requests in bucket 4: eager steps (no backend, the CPU's static one) are priced by their
    live rows; a captured one forwards the whole tier, so it keeps the table's price."""
    target = random_target(CFG, seed=7, dtype=torch.float64)
    draft = random_draft(CFG, seed=5, block_size=7).to(torch.float64)
    graphs = {None: None, "static": EagerStaticBackend("cpu"), "captured": StandInCapturedBackend("cpu")}[backend]
    engine = Engine(target, draft, EngineConfig(draft_width=WIDTH, request_buckets=(1, 2, 4), max_model_len=96,
                                                schedule_overlap=False), graphs=graphs)
    assert engine.runner.forwards_live_rows == (backend != "captured")
    reports: list[StepReport] = []
    engine.add_observer(reports.append)
    if graphs is not None:
        engine.warmup()
    engine.install_table(draft_off_table(WIDTH, (1, 2, 4), per_row=PER_ROW))
    engine.mark_ready()
    prompts = random_prompts(3, seed=9)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    engine.close()
    assert [list(o.token_ids) for o in outputs] == greedy_references(target, prompts, 12)
    partial = [r for r in reports if r.live_requests == 3 and r.request_bucket == 4]
    assert partial, "no step of three requests in bucket 4 ran"
    full = engine.costs.for_step(4, 100)
    for report in partial:
        if backend == "captured":
            np.testing.assert_array_equal(report.tier_costs, full)
        else:  # one anchor fewer than the table's full bucket, whatever the caps left to spend
            candidates = [engine.costs.for_live(4, 100, 3, spendable)[0] for spendable in range(3 * WIDTH + 1)]
            assert any(np.array_equal(report.tier_costs, c) for c in candidates)
            assert np.all(report.tier_costs < full)

"""A third-party cost model registered as an inline plugin serializes into the same bundle."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from attrs import frozen

from dspark_core.components import Component
from dspark_core.costs import Coverage, CostSample, RowSpan
from dspark_core.errors import PluginError, TableError
from dspark_core.geometry import full_width_rows
from dspark_core.hookspecs import hookimpl
from dspark_core.plugins import Hooks, build_plugin_manager
from dspark_core.table import dumps_table, fit_table, load_table, loads_table, save_table
from test_costs_support import fingerprint, grid_samples, settings, simple_cost


@frozen
class PerRowFit:
    """Seconds = base * rows; a deliberately different model."""

    draft_width: int
    base: float
    buckets: tuple[int, ...]
    model: str = "per-row"

    def predict_seconds(self, request_bucket: int, target_rows: int) -> float | None:
        if request_bucket not in self.buckets or not request_bucket <= target_rows <= full_width_rows(request_bucket, self.draft_width):
            return None
        return self.base * target_rows

    @property
    def coverage(self) -> Coverage:
        return Coverage(tuple(RowSpan(b, b, full_width_rows(b, self.draft_width)) for b in self.buckets))

    @property
    def params(self) -> dict[str, Any]:
        return {"base": self.base, "buckets": list(self.buckets)}


class PerRowModel:
    name = "per-row"

    def fit(self, samples: Sequence[CostSample], draft_width: int) -> PerRowFit:
        base = sum(s.step_seconds / s.target_rows for s in samples) / len(samples)
        return PerRowFit(draft_width, base, tuple(sorted({s.request_bucket for s in samples})))

    def load(self, params: Mapping[str, Any], draft_width: int) -> PerRowFit:
        return PerRowFit(draft_width, float(params["base"]), tuple(params["buckets"]))


class PerRowPlugin:
    @hookimpl
    def dspark_cost_model(self, name: str) -> PerRowModel | None:
        return PerRowModel() if name == "per-row" else None

    @hookimpl
    def dspark_components(self) -> list[Component]:
        return [Component("cost_model", "per-row", "seconds proportional to target rows")]


@pytest.fixture
def hooks() -> Hooks:
    pm = build_plugin_manager(autoload=False)
    pm.register(PerRowPlugin(), name="per-row")
    return Hooks(pm)


def test_third_party_model_round_trips_through_a_bundle(tmp_path, hooks):
    samples = grid_samples(simple_cost, (1, 2, 4), 3)
    table = fit_table(settings("per-row"), samples, hooks.cost_model, fingerprint())
    path = save_table(table, tmp_path / "per-row.json")
    loaded = load_table(path, hooks.cost_model)
    assert loaded == table
    assert dumps_table(loaded) == path.read_text()
    assert loaded.predict_seconds(2, 6, kv_length=10) == pytest.approx(table.fits[0].cost.base * 6)


def test_table_of_an_unregistered_model_names_it(tmp_path, hooks):
    text = dumps_table(fit_table(settings("per-row"), grid_samples(simple_cost, (1, 2, 4), 3), hooks.cost_model, fingerprint()))
    without = Hooks(build_plugin_manager(["additive", "sps"], autoload=False))
    with pytest.raises(TableError, match=r"\$.model: no cost model named 'per-row' \(available: additive, sps\)"):
        loads_table(text, without.cost_model, "per-row.json")


def test_fitting_an_unknown_model_is_a_plugin_error(hooks):
    with pytest.raises(PluginError, match="no cost model named 'additive'"):
        fit_table(settings("additive"), grid_samples(simple_cost, (1, 2, 4), 3), hooks.cost_model, fingerprint())

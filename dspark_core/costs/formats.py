"""JSON forms of a cost table: the versioned bundle, the bare table and legacy files.

Reading detects the form from the object's keys. Every form is structured
with the project's strict converter, so unknown keys and wrong types are
errors that name their JSON path. Cost models are looked up by name through
a caller-supplied function (normally ``Hooks.cost_model``), never imported.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from attrs import field, frozen

from dspark_core.convert import structure_checked, unstructure
from dspark_core.costs.base import Coverage, Measurement, measurement_tuple
from dspark_core.costs.bundle import CostTable, IntervalFit, Provenance
from dspark_core.costs.fingerprint import Fingerprint
from dspark_core.errors import ConfigError, PluginError, TableError
from dspark_core.fit_settings import CalibrationSettings, ContextInterval

SCHEMA_VERSION = 1
#: Width of tables written before the width was recorded (the Draft7 era).
LEGACY_DRAFT_WIDTH = 7
#: Lookup from a cost-model name to the object the ``dspark_cost_model`` hook returns.
CostModelLookup = Callable[[str], Any]



@frozen
class LegacyForm:
    """A table layout from before tables named their cost model: the keys that identify it,
    the model that reads it (through its ``read_legacy``) and a line for error messages."""

    keys: frozenset[str]
    model: str
    description: str


# Why the core still lists these two: a legacy file carries no "model" key, so its
# layout has to be recognised before any cost model is known, and letting every
# plugin claim arbitrary JSON through a hook would make the detected format depend
# on which plugins are loaded and in what order. Both layouts are frozen history
# (other engines' DSpark files), so the core keeps only which keys mean which model
# name; turning the document into that model's params is the model's own
# ``read_legacy(doc, source)``, next to its params.
LEGACY_FORMS = (
    LegacyForm(frozenset({"sample_batch_tokens", "sample_steps_per_sec"}), "sps",
               "legacy steps-per-second table {sample_batch_tokens, sample_steps_per_sec, max_batch_tokens}"),
    LegacyForm(frozenset({"bias_seconds", "theta_seconds"}), "additive",
               "legacy additive table {bias_seconds, bs_probes, alpha_seconds, m_probes, theta_seconds}"),
)

ACCEPTED_FORMATS = (
    "versioned bundle {schema_version, draft_width, model, fits, calibration, fingerprint, provenance}",
    "bare table {model, draft_width, params[, context]}",
    *(form.description for form in LEGACY_FORMS),
)


@frozen
class FitDoc:
    context: ContextInterval
    params: dict[str, Any]
    coverage: Coverage
    measurements: tuple[Measurement, ...] = field(default=(), converter=measurement_tuple)


@frozen
class BundleDoc:
    schema_version: int
    draft_width: int
    model: str
    fits: tuple[FitDoc, ...]
    calibration: CalibrationSettings
    fingerprint: Fingerprint
    provenance: Provenance


@frozen
class BareDoc:
    model: str
    params: dict[str, Any]
    draft_width: int | None = None
    context: ContextInterval | None = None


def resolve_cost_model(name: str, lookup: CostModelLookup) -> Any:
    """The cost model called ``name``; PluginError when no plugin provides it."""
    model = lookup(name)
    if model is None:
        raise PluginError(f"no cost model named {name!r}; load the plugin that provides it with --plugin")
    return model


def _table_model(name: str, lookup: CostModelLookup) -> Any:
    try:
        return resolve_cost_model(name, lookup)
    except PluginError as exc:  # while reading a table this is a table problem
        raise TableError(f"$.model: {exc}") from None


def _load_fit(model: Any, params: Mapping[str, Any], width: int, where: str) -> Any:
    try:
        return model.load(params, width)
    except ConfigError as exc:
        # The model reports "$.field"; place it inside the table document.
        raise TableError(str(exc).replace("@ $", f"@ {where}")) from None


def table_to_json(table: CostTable) -> dict[str, Any]:
    """The JSON object for ``table``: a bundle when it has a fingerprint, else bare."""
    if table.fingerprint is None:
        fit = table.fits[0]
        bare: dict[str, Any] = {"model": table.model, "draft_width": table.draft_width, "params": fit.cost.params}
        if fit.context is not None:
            bare["context"] = unstructure(fit.context)
        return bare
    return {
        "schema_version": SCHEMA_VERSION,
        "draft_width": table.draft_width,
        "model": table.model,
        "fits": [
            {
                "context": unstructure(f.context),
                "params": f.cost.params,
                "coverage": unstructure(f.coverage),
                "measurements": unstructure(f.measurements),
            }
            for f in table.fits
        ],
        "calibration": unstructure(table.settings),
        "fingerprint": unstructure(table.fingerprint),
        "provenance": unstructure(table.provenance),
    }


def _structure(data: Any, cls: type, source: str) -> Any:
    try:
        return structure_checked(data, cls, source=source)
    except ConfigError as exc:
        raise TableError(str(exc)) from None


def _from_bundle(data: Mapping[str, Any], lookup: CostModelLookup, source: str) -> CostTable:
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise TableError(f"{source}: schema_version {version!r} is not supported (this dspark-core reads {SCHEMA_VERSION})")
    doc: BundleDoc = _structure(data, BundleDoc, source)
    model = _table_model(doc.model, lookup)
    fits = []
    for i, f in enumerate(doc.fits):
        cost = _load_fit(model, f.params, doc.draft_width, f"$.fits[{i}].params")
        if cost.coverage != f.coverage:
            raise TableError(f"{source}: $.fits[{i}].coverage does not match what its params cover (edited by hand?)")
        fits.append(IntervalFit(f.context, cost, f.measurements))
    try:
        return CostTable(doc.draft_width, doc.model, fits, doc.calibration, doc.fingerprint, doc.provenance, "bundle", source)
    except TableError as exc:
        raise TableError(f"{source}: {exc}") from None


def _bare_table(model_name: str, params: Mapping[str, Any], width: int | None, context: Any, lookup: CostModelLookup,
                origin: str, source: str) -> CostTable:
    assumed = width is None
    width = LEGACY_DRAFT_WIDTH if width is None else width
    cost = _load_fit(_table_model(model_name, lookup), params, width, "$.params")
    return CostTable(width, model_name, [IntervalFit(context, cost)], origin=origin, source=source, width_assumed=assumed)


def _legacy_table(form: LegacyForm, data: Mapping[str, Any], lookup: CostModelLookup, source: str) -> CostTable:
    read_legacy = getattr(_table_model(form.model, lookup), "read_legacy", None)
    if read_legacy is None:
        raise TableError(f"{source}: a {form.description} is read by the {form.model!r} cost model, "
                         "and the plugin providing that name cannot read legacy tables (it has no read_legacy)")
    try:
        params, width = read_legacy(data, source)
    except ConfigError as exc:
        raise TableError(str(exc)) from None
    return _bare_table(form.model, params, width, None, lookup, f"legacy {form.model}", source)


def table_from_json(data: Any, lookup: CostModelLookup, source: str) -> CostTable:
    """Detect the form of ``data`` from its keys and build the table it holds."""
    if not isinstance(data, Mapping):
        raise TableError(f"{source}: expected a JSON object at $; accepted formats: " + "; ".join(ACCEPTED_FORMATS))
    keys = set(data)
    try:
        if "schema_version" in keys:
            return _from_bundle(data, lookup, source)
        if {"model", "params"} <= keys:
            bare: BareDoc = _structure(data, BareDoc, source)
            origin = "bare" if bare.draft_width is not None else "legacy bare"
            return _bare_table(bare.model, bare.params, bare.draft_width, bare.context, lookup, origin, source)
        for form in LEGACY_FORMS:
            if form.keys <= keys:
                return _legacy_table(form, data, lookup, source)
    except TableError as exc:
        text = str(exc)
        raise TableError(text if text.startswith(source) else f"{source}: {text}") from None
    shown = ", ".join(sorted(keys)[:8]) or "no keys"
    raise TableError(
        f"{source}: not a cost table (found keys: {shown}); accepted formats:\n  " + "\n  ".join(ACCEPTED_FORMATS)
    )


def render_json(value: Any, indent: int = 0) -> str:
    """Stable, diff-friendly JSON: one key per line; number lists and small records inline.

    Raises ValueError for NaN or infinity (a table must hold finite numbers).
    """
    pad = "  " * (indent + 1)
    if isinstance(value, Mapping) and not any(isinstance(v, (Mapping, list, tuple)) for v in value.values()):
        flat = json.dumps(value, allow_nan=False)
        if len(flat) <= 120:  # small records (spans, measurements) stay on one line
            return flat
    if isinstance(value, Mapping) and value:
        items = [f"{pad}{json.dumps(str(k))}: {render_json(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * indent + "}"
    if isinstance(value, (list, tuple)) and not any(isinstance(v, Mapping) for v in value):
        flat = json.dumps(value, allow_nan=False)
        if len(flat) <= 100 or not any(isinstance(v, (list, tuple)) for v in value):
            return flat  # short nested lists (geometry tiers) and all number lists stay inline
    if isinstance(value, (list, tuple)) and any(isinstance(v, (Mapping, list, tuple)) for v in value):
        items = [f"{pad}{render_json(v, indent + 1)}" for v in value]
        return "[\n" + ",\n".join(items) + "\n" + "  " * indent + "]"
    return json.dumps(value, allow_nan=False)

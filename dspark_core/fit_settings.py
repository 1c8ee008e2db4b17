"""The settings a cost table is fitted with: context intervals and calibration settings.

These value types are shared by the calibration file (``--adaptive_dspark_calibration``,
read by :mod:`dspark_core.calibration.plan`) and by the cost-table bundle
(:mod:`dspark_core.costs.bundle`), which records the settings a table was fitted
with. They live here, below both packages, so that neither ``costs`` nor
``calibration`` needs to import the other for them (``calibration`` uses
``costs``; never the reverse). :mod:`dspark_core.calibration.settings` re-exports
them under their old import path.

Resolving omitted fields to their defaults belongs to the calibration plan;
this module only holds the values, structures them strictly and checks the
rules that need nothing but the values themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union, cast

from attrs import field, frozen
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from dspark_core.convert import converter, structure_checked
from dspark_core.errors import ConfigError

#: Rows per bucket, as sorted ``(bucket, rows)`` pairs (hashable, unlike a dict).
RowsByBucket = tuple[tuple[int, tuple[int, ...]], ...]
#: Either one row list shared by every bucket, or a list per bucket.
TargetRows = Union[tuple[int, ...], RowsByBucket]


@frozen
class ContextInterval:
    """One KV-length interval that gets its own fit.

    Calibration prefills ``prefill_tokens`` tokens and then samples decode
    steps whose KV length stays within ``[min_kv_length, max_kv_length]``.
    """

    prefill_tokens: int
    min_kv_length: int
    max_kv_length: int

    def __attrs_post_init__(self) -> None:
        if self.prefill_tokens < 0:
            raise ConfigError(f"prefill_tokens must be >= 0, got {self.prefill_tokens}")
        if self.min_kv_length < 1:
            raise ConfigError(f"min_kv_length must be >= 1, got {self.min_kv_length}")
        if self.max_kv_length < self.min_kv_length:
            raise ConfigError(
                f"max_kv_length {self.max_kv_length} is below min_kv_length {self.min_kv_length}"
            )

    def contains(self, kv_length: int) -> bool:
        """True when ``kv_length`` lies in this closed interval."""
        return self.min_kv_length <= kv_length <= self.max_kv_length

    def overlaps(self, other: ContextInterval) -> bool:
        """True when the two closed KV ranges share at least one length."""
        return self.min_kv_length <= other.max_kv_length and other.min_kv_length <= self.max_kv_length

    def describe(self) -> str:
        """Short human form used in error messages and ``table show``."""
        return f"KV {self.min_kv_length}-{self.max_kv_length} (prefill {self.prefill_tokens})"


def check_contexts(contexts: Sequence[ContextInterval]) -> None:
    """Refuse overlapping intervals, naming both; a KV length must map to one fit."""
    ordered = sorted(enumerate(contexts), key=lambda item: item[1].min_kv_length)
    for (i, a), (j, b) in zip(ordered, ordered[1:]):
        if a.overlaps(b):
            first, second = sorted(((i, a), (j, b)))
            raise ConfigError(
                f"context intervals overlap: contexts[{first[0]}] {first[1].describe()} and "
                f"contexts[{second[0]}] {second[1].describe()}; each KV length must belong to one interval"
            )


def normalize_rows(value: Any) -> TargetRows | None:
    """``target_graph_rows`` in its one hashable form (sorted, unique)."""
    # Accept the Python forms (dict or flat list) as well as the normalized one,
    # so that equal settings compare equal however they were built.
    if value is None:
        return None
    if isinstance(value, Mapping):
        return tuple(sorted((int(b), tuple(sorted({int(g) for g in rows}))) for b, rows in value.items()))
    items = tuple(value)
    if items and isinstance(items[0], tuple) and len(items[0]) == 2 and isinstance(items[0][1], tuple):
        return tuple(sorted((int(b), tuple(sorted({int(g) for g in rows}))) for b, rows in items))
    return tuple(sorted({int(g) for g in items}))


def _sorted_unique(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted({int(v) for v in values}))


def _contexts(values: Iterable[ContextInterval]) -> tuple[ContextInterval, ...]:
    return tuple(values)  # a typed converter (see dspark_core.convert.int_tuple)


#: Accepted ``probe_order`` values.
PROBE_ORDERS = ("interleaved", "sequential")


@frozen
class CalibrationSettings:
    """Every calibration setting, as used for one fit (defaults already resolved)."""

    model: str
    draft_width: int
    request_buckets: tuple[int, ...] = field(converter=_sorted_unique)
    contexts: tuple[ContextInterval, ...] = field(converter=_contexts)
    warmup_steps: int
    window_steps: int
    windows_per_point: int
    token_seed: int
    # None: every legal captured tier of every bucket (resolved by the plan).
    target_graph_rows: TargetRows | None = field(default=None, converter=normalize_rows)
    # also probe one draft-off point (no draft, one row per request) per bucket, so the
    # adaptive policy may skip the draft on steps where drafting does not pay
    draft_off: bool = True
    # how a bucket's drafting rows share the timed steps (see dspark_core.calibration.probe):
    # "sequential" (one row count after another) or "interleaved" (they take turns step by
    # step). Tables saved before the setting existed were probed sequentially.
    probe_order: str = "sequential"

    def __attrs_post_init__(self) -> None:
        if self.probe_order not in PROBE_ORDERS:
            raise ConfigError(f"probe_order must be one of {', '.join(PROBE_ORDERS)}, got {self.probe_order!r}")
        if not self.model:
            raise ConfigError("model must name a cost model")
        if self.draft_width < 1:
            raise ConfigError(f"draft_width must be >= 1, got {self.draft_width}")
        if not self.request_buckets or self.request_buckets[0] < 1:
            raise ConfigError(f"request_buckets must be positive integers, got {list(self.request_buckets)}")
        if not self.contexts:
            raise ConfigError("contexts must hold at least one interval")
        check_contexts(self.contexts)
        for name in ("warmup_steps", "window_steps", "windows_per_point", "token_seed"):
            low = 1 if name in ("window_steps", "windows_per_point") else 0  # (numpy's seeds are >= 0)
            if getattr(self, name) < low:
                raise ConfigError(f"{name} must be >= {low}, got {getattr(self, name)}")
        self._check_rows()

    def _check_rows(self) -> None:
        rows = self.target_graph_rows
        if rows is None or not rows or not isinstance(rows[0], tuple):
            if rows is not None and any(g < 1 for g in cast(tuple[int, ...], rows)):  # the shared row list
                raise ConfigError(f"target_graph_rows must be positive, got {list(rows)}")
            return
        extra = sorted(set(dict(rows)) - set(self.request_buckets))
        if extra:
            raise ConfigError(f"target_graph_rows names buckets {extra} that are not in request_buckets")

    def rows_by_bucket(self) -> dict[int, tuple[int, ...]] | None:
        """Per-bucket rows when given as a mapping, else None."""
        return rows_by_bucket(self.target_graph_rows)


def rows_by_bucket(rows: TargetRows | None) -> dict[int, tuple[int, ...]] | None:
    """Normalized ``target_graph_rows`` as a bucket -> rows dict when given per bucket, else None."""
    if rows and isinstance(rows[0], tuple):
        return dict(rows)  # per bucket: (bucket, rows) pairs
    return None


def structure_rows(value: Any, _type: Any) -> TargetRows | None:
    """cattrs hook: ``target_graph_rows`` from JSON (a row list or an object of bucket -> rows)."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        out = []
        for key, rows in value.items():
            if not (isinstance(key, str) and key.isdigit()) and not isinstance(key, int):
                raise ConfigError(f"bucket key {key!r} is not a positive integer")
            out.append((int(key), tuple(converter.structure(rows, list[int]))))
        return normalize_rows(dict(out))
    if isinstance(value, list):
        return normalize_rows(converter.structure(value, list[int]))
    raise ConfigError(f"expected a list of rows or an object of bucket -> rows, got {value!r}")


def unstructure_rows(value: TargetRows | None) -> Any:
    if value is None:
        return None
    if value and isinstance(value[0], tuple):
        return {str(b): list(rows) for b, rows in value}
    return list(value)


converter.register_structure_hook(
    CalibrationSettings,
    make_dict_structure_fn(
        CalibrationSettings, converter, target_graph_rows=override(struct_hook=structure_rows)
    ),
)
converter.register_unstructure_hook(
    CalibrationSettings,
    make_dict_unstructure_fn(
        CalibrationSettings, converter, target_graph_rows=override(unstruct_hook=unstructure_rows)
    ),
)


def settings_from_json(data: Any, *, source: str = "calibration settings") -> CalibrationSettings:
    """Structure a JSON object strictly; errors name the JSON path (``$.contexts[0]...``)."""
    return structure_checked(data, CalibrationSettings, source=source)

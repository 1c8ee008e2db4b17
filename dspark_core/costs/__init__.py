"""Full-step cost models: shared types, the table bundle and its JSON forms.

Cost models themselves are plugins (``dspark_cost_model`` hook); the default
ones live in ``dspark_plugins.costs`` and are found through entry points.
"""

from dspark_core.costs.base import (
    CostModel,
    CostSample,
    Coverage,
    FittedCost,
    Measurement,
    RowSpan,
    pool_samples,
)
from dspark_core.costs.bundle import CostTable, IntervalFit, Provenance
from dspark_core.costs.fingerprint import Execution, Fingerprint, ModelIdentity, Parallelism, launch_fingerprint

__all__ = [
    "CostModel", "CostSample", "CostTable", "Coverage", "Execution", "Fingerprint", "FittedCost",
    "IntervalFit", "Measurement", "ModelIdentity", "Parallelism", "Provenance", "RowSpan",
    "launch_fingerprint", "pool_samples",
]

"""Static-shape mode: a forward with no host synchronisation and no data-dependent shapes.

A device graph (ACL graph, CUDA graph) records kernels with fixed shapes and
cannot read values back to the host while recording. The eager forward does
both: it sizes the padded per-request view and the key range from the batch
(``.item()``) and runs only the experts some row chose. In static mode the
GLM-DSA target instead treats every row on its own, scans the full cache
length (positions after a row's own are masked) and runs every expert with a
zero weight where it was not chosen — same results, shapes fixed by the
binding key. The aclgraph backend turns the mode on around capture; a target
can also be pinned to it (``GlmDsaTarget.static_shapes = True``).
"""

from __future__ import annotations

from dspark_core.graphs import static_shapes, static_shapes_active  # noqa: F401  (shared by every target)


class PerRow:
    """The trivial grouping of static mode: each row is its own group of one (``[G] -> [G, 1]``)."""

    @staticmethod
    def pad(rows):
        return rows[:, None]

    @staticmethod
    def unpad(padded):
        return padded[:, 0]

"""Copy proposals: which order and which confidences a runner uses.

The lookup itself is a kernel (:mod:`dspark_kernels.copy_lookup`) run inside
the proposal key; this module only resolves the settings, from the launch's
request and the draft's config.
"""

from __future__ import annotations

from dspark_core.errors import ConfigError
from dspark_core.models.base import DraftModel

#: Key lengths copy proposals try, longest first, when asked for with a draft whose config sets
#: none. Teacher forced on greedy answers to training-side ShareGPT prompts (docs/draft-training.md),
#: a draft with copies of the last 2 tokens reached tau 3.10 at K=7, with 6..2 tokens 3.47.
DEFAULT_COPY_ORDERS = (6, 5, 4, 3, 2)
#: Confidence of a copied token when the draft's config has no fitted ones.
DEFAULT_COPY_CONFIDENCE = 0.8
COPY_MODES = ("auto", "on", "off")


def copy_settings(draft: DraftModel | None, mode: str, draft_width: int
                  ) -> tuple[tuple[int, ...], list[list[float]]]:
    """The key lengths copy proposals try (longest first; empty: no copies) and the copied-token
    confidences, one row of ``draft_width`` per key length.

    ``mode`` ``auto`` follows the draft's config (``copy_order``; none set: no copies), ``on`` uses
    the draft's orders or :data:`DEFAULT_COPY_ORDERS`, ``off`` turns copies off. Without a draft
    there is nothing to copy into."""
    if mode not in COPY_MODES:
        raise ConfigError(f"copy_proposals={mode!r}: expected one of {', '.join(COPY_MODES)}")
    config = getattr(draft, "config", None)
    own = tuple(getattr(config, "copy_orders", ()) or ())
    orders = {"auto": own, "on": own or DEFAULT_COPY_ORDERS, "off": ()}[mode]
    if draft is None or not orders:
        return (), []
    fitted = getattr(config, "copy_confidences", None) if orders == own else None
    if fitted:
        return orders, [list(row[:draft_width]) for row in fitted]
    return orders, [[DEFAULT_COPY_CONFIDENCE] * draft_width for _ in orders]


"""Copy proposals: which order and which confidences a runner uses.

The lookup itself is a kernel (:mod:`dspark_kernels.copy_lookup`) run inside
the proposal key; this module only resolves the settings, from the launch's
request and the draft's config.
"""

from __future__ import annotations

from dspark_core.errors import ConfigError
from dspark_core.models.base import DraftModel

#: Order of copy proposals when asked for with a draft whose config sets none: the last two
#: tokens (one token matches too often, three too rarely; docs/draft-training.md).
DEFAULT_COPY_ORDER = 2
#: Confidence of a copied token when the draft's config has no fitted ones.
DEFAULT_COPY_CONFIDENCE = 0.8


COPY_MODES = ("auto", "on", "off")


def copy_settings(draft: DraftModel | None, mode: str, draft_width: int) -> tuple[int, list[float]]:
    """The copy order (0: no copies) and per-position copied-token confidences of a runner.

    ``mode`` ``auto`` follows the draft's config (``copy_order``; none set: no copies), ``on`` uses
    the draft's order or :data:`DEFAULT_COPY_ORDER`, ``off`` turns copies off. Without a draft there
    is nothing to copy into."""
    if mode not in COPY_MODES:
        raise ConfigError(f"copy_proposals={mode!r}: expected one of {', '.join(COPY_MODES)}")
    config = getattr(draft, "config", None)
    own_order = int(getattr(config, "copy_order", 0) or 0)
    order = {"auto": own_order, "on": own_order or DEFAULT_COPY_ORDER, "off": 0}[mode]
    if draft is None or order <= 0:
        return 0, [DEFAULT_COPY_CONFIDENCE] * draft_width
    fitted = getattr(config, "copy_confidences", None)
    confidences = list(fitted) if fitted else [DEFAULT_COPY_CONFIDENCE] * draft_width
    return order, confidences[:draft_width]

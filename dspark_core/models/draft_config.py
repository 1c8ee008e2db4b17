"""Configuration of a DSpark draft (the fields of a speculators ``dspark`` checkpoint)."""

from __future__ import annotations

from attrs import field, frozen

from dspark_core.convert import int_tuple
from dspark_core.errors import ModelError

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
MAX_COPY_ORDER = 8


def _confidence_rows(value) -> tuple[tuple[float, ...], ...] | None:
    """Copy confidences as rows per order; a flat list is the one row of a single order."""
    if value is None:
        return None
    values = list(value)
    if values and not isinstance(values[0], (list, tuple)):
        return (tuple(float(c) for c in values),)
    return tuple(tuple(float(c) for c in row) for row in values)


@frozen
class DraftConfig:
    """Shape and behaviour of a DSpark draft.

    ``aux_layer_ids`` are target hidden-state indices in the speculators sense
    (layer index + 1, i.e. the residual stream after that many target layers);
    they are passed unchanged as ``hidden_layers`` to the target's forward.
    ``sts_temperatures`` holds one temperature per proposed position; the
    confidence of position j is ``sigmoid(logit_j / T_j)`` (all 1.0 = raw head).
    ``copy_order`` > 0 puts copy proposals (prompt lookup) in front of the
    draft's block, matching the last ``copy_order`` tokens first and shorter
    keys down to ``copy_min_order`` (default: ``copy_order`` alone).
    ``copy_confidences`` holds, per order (longest first) and proposed
    position, the chance that copied token j is accepted once tokens 1..j-1 were.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    target_vocab_size: int
    draft_vocab_size: int
    block_size: int
    aux_layer_ids: tuple[int, ...] = field(converter=int_tuple)
    mask_token_id: int
    target_hidden_size: int
    rms_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position: int = 40960
    attention_bias: bool = False
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    sample_from_anchor: bool = True
    sts_temperatures: tuple[float, ...] | None = field(default=None, converter=lambda v: None if v is None else tuple(float(x) for x in v))
    copy_order: int = 0
    copy_min_order: int | None = None
    copy_confidences: tuple[tuple[float, ...], ...] | None = field(default=None, converter=_confidence_rows)

    def __attrs_post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ModelError(f"draft config: {msg}")

        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "target_vocab_size", "draft_vocab_size", "target_hidden_size"):
            if getattr(self, name) <= 0:
                bad(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            bad(f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.draft_vocab_size > self.target_vocab_size:
            bad(f"draft_vocab_size {self.draft_vocab_size} exceeds the target vocabulary {self.target_vocab_size}")
        if self.block_size < (1 if self.sample_from_anchor else 2):
            bad(f"block_size {self.block_size} proposes no token")
        if not self.aux_layer_ids:
            bad("aux_hidden_state_layer_ids must not be empty")
        if not 0 <= self.mask_token_id < self.target_vocab_size:
            bad(f"mask_token_id {self.mask_token_id} is outside the target vocabulary")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            bad(f"markov_head_type {self.markov_head_type!r} is not one of {MARKOV_HEAD_TYPES}")
        if self.markov_rank < 0:
            bad(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            bad("confidence_head_with_markov needs markov_rank > 0")
        if self.sts_temperatures is not None:
            if len(self.sts_temperatures) != self.num_speculative_tokens:
                bad(f"sts_temperatures has {len(self.sts_temperatures)} entries, expected {self.num_speculative_tokens} (one per proposed token)")
            if any(t <= 0 for t in self.sts_temperatures):
                bad("sts_temperatures must all be > 0")
        if not 0 <= self.copy_order <= MAX_COPY_ORDER:
            bad(f"copy_order must be 0 (no copies) .. {MAX_COPY_ORDER}, got {self.copy_order}")
        if self.copy_min_order is not None and not 1 <= self.copy_min_order <= max(self.copy_order, 1):
            bad(f"copy_min_order must be 1 .. copy_order ({self.copy_order}), got {self.copy_min_order}")
        if self.copy_confidences is not None:
            rows, k = len(self.copy_orders), self.num_speculative_tokens
            if len(self.copy_confidences) != rows or any(len(row) != k for row in self.copy_confidences):
                bad(f"copy_confidences must hold {rows} row(s) (one per copy order, longest first) of {k} values "
                    f"(one per proposed token), got {[len(row) for row in self.copy_confidences]}")
            if any(not 0 < c <= 1 for row in self.copy_confidences for c in row):
                bad(f"copy_confidences must lie in (0, 1], got {[list(row) for row in self.copy_confidences]}")

    @property
    def num_speculative_tokens(self) -> int:
        """K: tokens proposed per block (the anchor slot proposes too when sample_from_anchor)."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def copy_orders(self) -> tuple[int, ...]:
        """The key lengths copy proposals try, longest first (empty: no copies)."""
        if self.copy_order <= 0:
            return ()
        return tuple(range(self.copy_order, (self.copy_min_order or self.copy_order) - 1, -1))

    @property
    def first_proposal_slot(self) -> int:
        """Block slot whose output is the first proposed token."""
        return 0 if self.sample_from_anchor else 1

    @property
    def temperatures(self) -> tuple[float, ...]:
        """Per-position STS temperatures (1.0 everywhere unless calibrated)."""
        return self.sts_temperatures or (1.0,) * self.num_speculative_tokens

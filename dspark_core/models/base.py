"""Value objects shared by every target model: configuration and the packed row batch.

A forward pass works on *rows*: one row is one token of one request at one
position. Rows of all requests in a step are packed back to back (``G`` rows in
total), so the cost of every linear layer scales with ``G`` and not with the
longest request times the batch size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from attrs import field, frozen

from dspark_core.convert import int_tuple
from dspark_core.errors import ModelError


@frozen
class TargetConfig:
    """Architecture of a Llama-family decoder (covers SmolLM2, Llama, Qwen2/3 dense)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False  # qwen2 style
    qk_norm: bool = False  # qwen3 style
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=(), converter=int_tuple)

    def __attrs_post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(f"model config: num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelError(f"model config: head_dim must be even for rotary embeddings, got {self.head_dim}")


@frozen
class ForwardBatch:
    """Packed rows of one forward pass over ``B`` requests.

    ``tokens`` and ``positions`` have one entry per row (``G`` rows). The rows
    of request ``b`` are ``row_offsets[b]:row_offsets[b + 1]``; their positions
    are contiguous and ascending. ``slot_ids[b]`` is the KV-cache slot of
    request ``b``. A request may contribute zero rows only if every request
    does (an empty batch is not useful), so callers pass only live requests.

    ``padding_slot`` names the slot of padding requests (the engine's scratch
    slot, which fixed-shape steps fill up with): their rows' logits and hidden
    states are never read, so a model may attend them to anything.

    ``max_request_rows`` bounds the rows of every request not on ``padding_slot``
    (a verify step: the anchor and at most min(K, G - B) drafted tokens). A static-shape
    forward cannot read the row counts, so without it a request's attention is
    sized for all ``G`` rows; with it, for the bound, and the padding request's
    rows past the bound share its last attended row's result.

    ``padding_last`` says that the last request is the padding request (on
    ``padding_slot``, holding only the tier's padding rows) and that at least one
    request comes before it. A static-shape forward that gathers each request's
    keys cannot read that the request's results are unused; told so, it leaves
    the request out of attention, and its rows read back another row's result
    (at one live request the keys of one slot are gathered, not two). A forward
    that reads the cache in place leaves the padding slot out where it is the
    cache's last slot, as the engine's scratch slot is, flag or not.
    """

    tokens: torch.Tensor  # int64 [G]
    positions: torch.Tensor  # int64 [G]
    slot_ids: torch.Tensor  # int64 [B]
    row_offsets: torch.Tensor  # int64 [B + 1]
    padding_slot: int | None = None
    max_request_rows: int | None = None
    padding_last: bool = False

    def __attrs_post_init__(self) -> None:
        if self.padding_last and self.padding_slot is None:
            raise ModelError("a forward batch with padding_last=True needs the padding_slot its last request is on")
        if self.padding_last and self.slot_ids.shape[0] < 2:
            raise ModelError("a forward batch with padding_last=True needs a request before the padding one")

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def to(self, device: torch.device | str) -> ForwardBatch:
        """The same batch with every tensor on ``device``."""
        return ForwardBatch(self.tokens.to(device), self.positions.to(device), self.slot_ids.to(device),
                            self.row_offsets.to(device), self.padding_slot, self.max_request_rows, self.padding_last)


def make_forward_batch(
    tokens: Sequence[Sequence[int]],
    start_positions: Sequence[int],
    slot_ids: Sequence[int],
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    """Build a :class:`ForwardBatch` from python lists.

    ``tokens[b]`` are the new tokens of request ``b``; they sit at positions
    ``start_positions[b], start_positions[b] + 1, ...``. Every request needs
    at least one token.
    """
    if not (len(tokens) == len(start_positions) == len(slot_ids)):
        raise ValueError(f"tokens, start_positions and slot_ids differ in length: {len(tokens)}, {len(start_positions)}, {len(slot_ids)}")
    flat_tokens: list[int] = []
    flat_positions: list[int] = []
    offsets = [0]
    for row_tokens, start in zip(tokens, start_positions, strict=True):
        if len(row_tokens) == 0:
            raise ValueError("every request in a forward batch needs at least one token")
        flat_tokens.extend(int(t) for t in row_tokens)
        flat_positions.extend(range(int(start), int(start) + len(row_tokens)))
        offsets.append(len(flat_tokens))

    def as_long(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=device)

    return ForwardBatch(as_long(flat_tokens), as_long(flat_positions), as_long(slot_ids), as_long(offsets))


@frozen
class ForwardOutput:
    """What a target forward returns: float32 logits per row (or, asked for ``greedy_only``, each
    row's greedy token), optional hidden states."""

    logits: torch.Tensor | None  # float32 [G, V]; None when the forward gave greedy tokens only
    hidden: torch.Tensor | None  # [G, len(hidden_layers) * d] or None
    tokens: torch.Tensor | None = None  # int64 [G]: the greedy tokens, with greedy_only

    def full_logits(self) -> torch.Tensor:
        """The logits, for callers that asked for them (not ``greedy_only``)."""
        if self.logits is None:
            raise ModelError("this forward ran with greedy_only=True and computed greedy tokens, not logits")
        return self.logits


@runtime_checkable
class TargetModel(Protocol):
    """The interface the engine uses for a target model (the model runner holds one)."""

    config: TargetConfig  # a family may use its own config class with these fields
    device: torch.device
    dtype: torch.dtype

    def new_cache(self, num_slots: int, max_len: int) -> Any:
        """Allocate a static KV cache for ``num_slots`` requests of ``max_len`` tokens."""
        ...

    def forward(self, batch: ForwardBatch, cache: Any, hidden_layers: tuple[int, ...] = (),
                logit_rows: torch.Tensor | None = None, greedy_only: bool = False) -> ForwardOutput:
        """Write the rows' K/V into ``cache`` then return their logits (and hidden states).

        ``logit_rows`` (row indices): logits of those rows only, in that order. A prefill reads one
        row per prompt, and the LM head over every prompt row would cost as much as the rest of the
        forward. Hidden states are returned for every row either way. ``greedy_only``: return each
        logit row's greedy token (the first index of its largest logit) in ``tokens``; the logits
        may then be left out (None), which lets a model skip most of its LM head. Greedy decoding
        (the engine) asks for this; the tokens must depend on the row alone, as the logits do."""
        ...


@runtime_checkable
class DraftModel(Protocol):
    """The interface the engine uses for a DSpark draft (the model runner holds one, or none).

    A draft with a ``padding_slot`` attribute is told, after :meth:`allocate_context`, the context
    slot whose entries in a proposal batch are padding (the engine's scratch slot: their proposals
    are never read), so that it may lay a batch out by slot (the DSpark draft reads its context in
    place that way)."""

    config: Any  # a DraftConfig: num_speculative_tokens and aux_layer_ids are read

    def bind_target(self, target: Any) -> Any:
        """Share what the draft takes from the target (embeddings, head); returns the draft."""
        ...

    def allocate_context(self, num_slots: int, max_len: int) -> Any:
        """Allocate the per-slot context cache the draft attends to."""
        ...

    def extend_context(self, hidden: torch.Tensor, positions: torch.Tensor, slot_of_row: torch.Tensor) -> None:
        """Append the target's hidden states of the given rows to their slots' context."""
        ...

    def propose(self, anchor_tokens: torch.Tensor, anchor_positions: torch.Tensor,
                slot_ids: torch.Tensor, depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A block of drafted tokens and their confidences per request ``[B, K]`` each. Copy proposals
        need nothing from the draft: the engine replaces the block of a request that has one.

        ``depth`` (1..K; None: K) asks for the first ``depth`` tokens only, the rest returned with
        confidence 0 (``--draft_depths``). A draft whose ``propose`` takes no ``depth`` keyword is
        only ever asked for whole blocks, and a launch with depths refuses it."""
        ...


class ModelFamily(Protocol):
    """What a ``dspark_model_family`` hook returns: loads (and optionally shards) one family's targets.

    The optional ``shard_target(target, rank, world_size, group)`` cuts a loaded
    target in place into one rank's tensor-parallel shard; a family without it
    refuses ``--nnodes > 1``.
    """

    name: str

    def load_target(self, path: Any, *, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> Any:
        """The target model at ``path`` (a :class:`TargetModel`; its tokenizer is ``model.tokenizer``)."""
        ...

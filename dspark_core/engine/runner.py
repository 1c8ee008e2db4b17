"""The model runner: owns the target, the draft, their caches and the width's kernels.

It knows nothing about requests; it runs tensors through models. The engine
decides what to run, :mod:`dspark_core.engine.step` decides in which order.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping, Sequence
from functools import partial

import torch

from dspark_core.device import host_to_device
from dspark_core.engine.copies import copy_settings
from dspark_core.engine.draft_context import DraftContextQueue
from dspark_core.engine.slots import SlotStorage
from dspark_core.errors import ConfigError, ModelError
from dspark_core.geometry import Geometry, span_for
from dspark_core.graphs import BindingKey, GraphBackend, static_shapes_active
from dspark_core.models.base import DraftModel, ForwardBatch, ForwardOutput, TargetModel
from dspark_core.models.layers import greedy_tokens
from dspark_core.policy import step_draft_depth
from dspark_kernels import kernels_for
from dspark_kernels.accept_commit import Acceptance, gather_target_tokens
from dspark_kernels.pack import PackedRows

# most target rows queued for the draft's context before they are written anyway (bounds the
# memory a long draft-off stretch holds: 4096 rows of SmolLM2's three 576-wide layers are 28 MB)
PENDING_CONTEXT_ROWS = 4096

# The runner each draft instance serves. A draft holds one context cache, the one its last runner
# allocated; an earlier runner that kept using it would write and read another engine's context
# (still exact, since the target verifies, but proposals from the wrong context are rarely accepted).
_DRAFT_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ModelRunner:
    """Target + optional DSpark draft over one static slot cache (plus a scratch slot), and the slot
    storage (anchors, committed tokens) that a step reads and commits to on the device."""

    def __init__(self, target: TargetModel, draft: DraftModel | None, *, draft_width: int, num_slots: int,
                 max_len: int, graphs: GraphBackend | None = None, copy_proposals: str = "auto",
                 kv_spans: tuple[int, ...] = (), draft_depths: Mapping[int, int] | None = None) -> None:
        self.target = target
        self.graphs = graphs
        self.draft = draft
        self.draft_width = draft_width
        self.num_slots = num_slots
        self.max_len = max_len
        # KV spans (below max_len) the keys reading the cache are also prepared for (geometry.kv_spans)
        self.kv_spans = tuple(sorted(kv_spans))
        self.scratch_slot = num_slots
        self.device = target.device
        # the scratch slot as a device tensor, made once here: a verify key appends it to its slots
        # without a fill kernel on every replay
        self._scratch_slot_id = torch.full((1,), num_slots, dtype=torch.int64, device=self.device)
        self.kernels = kernels_for(draft_width)
        self.target_cache = target.new_cache(num_slots + 1, max_len)
        self.storage = SlotStorage(num_slots, draft_width, max_len, device=self.device)
        self.hidden_layers: tuple[int, ...] = ()
        self.draft_context: DraftContextQueue | None = None  # target rows waiting for the draft's context
        self._draft_guarded = False  # registered as the draft's owner (see _DRAFT_OWNERS)
        if draft is not None:
            available = draft.config.num_speculative_tokens
            if draft_width > available:
                raise ConfigError(
                    f"num_speculative_tokens={draft_width}: the draft proposes at most {available} tokens per block"
                )
            draft.bind_target(target)
            draft.allocate_context(num_slots + 1, max_len)
            if hasattr(draft, "padding_slot"):  # a draft that reads its context in place where it can
                draft.padding_slot = self.scratch_slot  # (models/context_cells) learns which entries are padding
            try:
                _DRAFT_OWNERS[draft] = weakref.ref(self)
                self._draft_guarded = True
            except TypeError:  # a draft object that takes no weak references goes unguarded
                pass
            self.hidden_layers = tuple(draft.config.aux_layer_ids)
            self.draft_context = DraftContextQueue(draft, num_slots=num_slots, max_len=max_len,
                                                   scratch_slot=self.scratch_slot, max_rows=PENDING_CONTEXT_ROWS)
        # request bucket -> tokens the draft proposes there, where fewer than K (--draft_depths)
        self.draft_depths = checked_draft_depths(draft, draft_depths or {}, draft_width)
        self.copy_orders, copy_confidences = copy_settings(draft, copy_proposals, draft_width)
        # one row per order, longest first, and a last row for slots without a match (never read)
        self.copy_confidences = torch.tensor(copy_confidences + [[0.0] * draft_width], dtype=torch.float32,
                                             device=self.device)
        # whether proposals copy (a launch with copies can turn them off and on: a bench compares both)
        self.copies_on = bool(self.copy_orders)
        # decoding is greedy: a target that can give greedy tokens without full logits is asked to
        # (a model family's target written before the option gets the plain call)
        self.target_gives_greedy = _takes_greedy_only(target)

    def forward(self, batch: ForwardBatch, logit_rows: torch.Tensor | None = None, greedy_only: bool = False) -> ForwardOutput:
        """Target forward that also returns the draft's hidden states when a draft exists; with
        ``greedy_only``, the greedy tokens instead of the logits where the target can (read them
        with :func:`_greedy`)."""
        if greedy_only and self.target_gives_greedy:
            return self.target.forward(batch, self.target_cache, hidden_layers=self.hidden_layers, logit_rows=logit_rows,
                                       greedy_only=True)
        return self.target.forward(batch, self.target_cache, hidden_layers=self.hidden_layers, logit_rows=logit_rows)

    def extend_draft_context(self, hidden: torch.Tensor | None, positions: torch.Tensor, row_slots: torch.Tensor) -> None:
        """Queue the target's hidden states of these rows for the draft's context cache; they are
        written right before the next proposal (see :mod:`dspark_core.engine.draft_context`)."""
        if self.draft_context is None or hidden is None:
            return
        if self.graphs is not None and self.graphs.records:
            # a recorded graph's output buffers are overwritten by its next replay, and (pools shared
            # per key family, see graphs.pool_family) by the next replay of any verify key
            hidden, positions, row_slots = hidden.clone(), positions.clone(), row_slots.clone()
        self.draft_context.put(hidden, positions, row_slots)

    def flush_draft_context(self) -> None:
        """Write every queued row into the draft's context cache (the runner does it before proposing)."""
        if self.draft_context is not None:
            self._check_draft_owner()
            self.draft_context.flush()

    def _check_draft_owner(self) -> None:
        if self._draft_guarded and _DRAFT_OWNERS[self.draft]() is not self:
            raise ModelError("this engine's draft instance was bound to another engine built after it: a draft "
                             "holds the context cache of the last engine built with it, so this engine would "
                             "propose from that engine's context; load one draft instance per engine")

    def release_draft_context(self, slot: int) -> None:
        """The request in ``slot`` ended: its queued rows need not be written."""
        if self.draft_context is not None:
            self.draft_context.release(slot)

    def prefill(self, prompts: Sequence[Sequence[int]], slots: Sequence[int]) -> torch.Tensor:
        """Run the prompts, fill both caches, return each request's first greedy token."""
        tokens = [t for prompt in prompts for t in prompt]
        positions = [p for prompt in prompts for p in range(len(prompt))]
        row_slots = [s for prompt, s in zip(prompts, slots) for _ in prompt]
        offsets = [0]
        for prompt in prompts:
            offsets.append(offsets[-1] + len(prompt))
        as_long = lambda xs: host_to_device(xs, self.device)  # noqa: E731
        batch = ForwardBatch(as_long(tokens), as_long(positions), as_long(list(slots)), as_long(offsets))
        last_rows = as_long(offsets[1:]) - 1
        out = self.forward(batch, logit_rows=last_rows, greedy_only=True)
        self.extend_draft_context(out.hidden, batch.positions, as_long(row_slots))
        self.storage.write_prompts(batch.tokens, batch.positions, as_long(row_slots))
        return _greedy(out)

    # -- the draft proposal, through the graph backend ----------------------------
    def span_for(self, kv_length: int) -> int:
        """The KV span of a step whose positions are all below ``kv_length`` (0: the whole cache)."""
        return span_for(self.kv_spans, kv_length)

    def depth_for(self, request_bucket: int, policy: object = None) -> int:
        """Tokens the draft proposes in a step of ``request_bucket`` under ``policy``
        (:func:`~dspark_core.policy.step_draft_depth`)."""
        return step_draft_depth(policy, self.draft_depths, request_bucket, self.draft_width)

    def propose_from_storage(self, slots: torch.Tensor, request_bucket: int | None = None, kv_span: int = 0,
                             depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K drafted tokens and their confidences for the requests in ``slots``, drafted from their
        anchors in slot storage and recorded there.

        With a graph backend and a request bucket the block runs as the bucket's ``propose`` key
        (padded to the bucket on the scratch slot), anchors read and proposal recorded inside it;
        otherwise eagerly. ``depth``: tokens the draft proposes (default K; see :meth:`depth_for`).
        """
        depth = self.draft_width if depth is None else depth
        if self.graphs is None or request_bucket is None:
            self.flush_draft_context()
            return self._propose_fn(slots, copies=self.copies_on, depth=depth)
        n = slots.shape[0]
        tokens, confidences = self.propose_bucket(pad_to(slots, request_bucket, self.scratch_slot), request_bucket, kv_span,
                                                  depth)
        return tokens[:n], confidences[:n]

    def propose_bucket(self, bucket_slots: torch.Tensor, request_bucket: int, kv_span: int = 0,
                       depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's ``propose`` key on slots already padded to it (the scratch slot); returns the
        key's whole outputs, one row per bucket entry (rows of the scratch slot are meaningless)."""
        self.flush_draft_context()
        assert self.graphs is not None, "propose_bucket runs the proposal key of a graph backend"
        key = self.proposal_key(request_bucket, self.copies_on, kv_span, self.draft_width if depth is None else depth)
        tokens, confidences = self.graphs.run(key, {"slot_ids": bucket_slots})
        return tokens, confidences

    def copy_bucket(self, bucket_slots: torch.Tensor, request_bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy proposals alone, without the draft (a copy step): the bucket's ``copy`` key on slots
        padded to it, or eagerly without a graph backend. A slot without a match gets zeros as tokens
        and as confidences, so no budget is spent on it."""
        if self.graphs is None:
            return self._copy_fn(bucket_slots)
        tokens, confidences = self.graphs.run(self.copy_key(request_bucket), {"slot_ids": bucket_slots})
        return tokens, confidences

    def copy_key(self, request_bucket: int) -> BindingKey:
        return BindingKey(self.draft_width, request_bucket, 0, str(self.target.dtype).removeprefix("torch."),
                          str(self.device), stage="copy")

    def _copy_fn(self, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The copy key: the copy lookup over slot storage and the fitted confidences of the order that
        matched (the no-match row is zeros). The draft's context is not touched, so the rows queued
        for it stay queued. Rows of empty bucket entries (the scratch slot) are left as they come: those
        entries have cap -1, so nothing reads them."""
        copied, _, order_index = self.storage.copies(slot_ids, self.copy_orders)
        return copied, self.copy_confidences[order_index]

    def propose(self, anchors: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """K drafted tokens and their confidences from explicit anchors, eagerly (no graph key, nothing
        recorded in slot storage): for tools that draft outside a decode step."""
        self.flush_draft_context()
        return self._draft_block(anchors, positions, slots)

    def set_copies(self, on: bool) -> None:
        """Turn copy proposals on or off (on needs a launch with copies: their keys are prepared)."""
        if on and not self.copy_orders:
            raise ConfigError("copy proposals cannot be turned on: this engine was built without them "
                              "(copy_proposals=off, or auto with a draft whose config sets no copy_order)")
        self.copies_on = on

    @property
    def draft_dtype(self) -> str | None:
        """The dtype the draft computes in (``bfloat16`` ...), read from its weights; None without a draft."""
        if self.draft is None:
            return None
        weight = getattr(getattr(self.draft, "fc", None), "weight", None)  # test doubles wrap a draft
        return str(self.target.dtype if weight is None else weight.dtype).removeprefix("torch.")

    def proposal_key(self, request_bucket: int, copies: bool = False, kv_span: int = 0, depth: int | None = None
                     ) -> BindingKey:
        dtype = self.draft_dtype or str(self.target.dtype).removeprefix("torch.")
        cut = depth if depth is not None and depth < self.draft_width else 0  # all K keeps depth 0, as before depths
        return BindingKey(self.draft_width, request_bucket, 0, dtype, str(self.device),
                          stage="propose+copy" if copies else "propose", kv_span=kv_span, draft_depth=cut)

    def _propose_fn(self, slot_ids: torch.Tensor, *, copies: bool = False, depth: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The proposal key: anchors from slot storage, the draft's block (led by copied tokens with
        ``copies``), the record in slot storage. Empty bucket entries (the scratch slot) draft token 0
        at position 0 and copy nothing: no context visible, the block is computed and dropped."""
        anchors, positions = self.storage.anchors(slot_ids)
        live = slot_ids != self.scratch_slot
        anchors, positions = torch.where(live, anchors, 0), torch.where(live, positions, 0)
        if copies:
            copied, copy_lengths, order_index = self.storage.copies(slot_ids, self.copy_orders)
            tokens, confidences = self._draft_block(anchors, positions, slot_ids, copied, torch.where(live, copy_lengths, 0),
                                                    self.copy_confidences[order_index], depth=depth)
        else:
            tokens, confidences = self._draft_block(anchors, positions, slot_ids, depth=depth)
        self.storage.record_proposal(slot_ids, tokens, confidences)
        return tokens, confidences

    def _draft_block(self, anchors: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                     copied: torch.Tensor | None = None, copy_lengths: torch.Tensor | None = None,
                     copy_confidences: torch.Tensor | None = None, depth: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's block; with ``copied`` tokens, request b's block starts with the first
        ``copy_lengths[b]`` of them, with ``copy_confidences[b]`` as their confidences. The lookup
        fills the whole width wherever it finds a copy (it repeats a short one), so a block is all
        copy or all draft, and the draft needs no part in it. ``depth`` < K: the draft proposes only
        that many tokens (the rest have confidence 0); a copy still fills the whole width."""
        assert self.draft is not None, "propose without a draft"  # the engine never drafts without one
        if depth is None or depth >= self.draft_width:
            tokens, confidences = self.draft.propose(anchors, positions, slot_ids)
        else:
            tokens, confidences = self.draft.propose(anchors, positions, slot_ids, depth=depth)
        tokens, confidences = tokens[:, : self.draft_width], confidences[:, : self.draft_width]
        if copied is None or copy_lengths is None or copy_confidences is None:
            return tokens, confidences
        is_copy = torch.arange(self.draft_width, device=tokens.device).unsqueeze(0) < copy_lengths.unsqueeze(1)
        return torch.where(is_copy, copied, tokens), torch.where(is_copy, copy_confidences, confidences.float())

    # -- verify, accept and commit, through the graph backend -----------------------
    def binding_key(self, request_bucket: int, target_rows: int, write_context: bool = False, kv_span: int = 0) -> BindingKey:
        """The verify key of a (bucket, tier); the bucket's own tier has a second key that writes its rows
        into the draft's context (``write_context``, stage ``verify+context``), used by drafted steps."""
        own_tier_writes = write_context and target_rows == request_bucket
        return BindingKey(self.draft_width, request_bucket, target_rows, str(self.target.dtype).removeprefix("torch."),
                          str(self.device), stage="verify+context" if own_tier_writes else "verify", kv_span=kv_span)

    def verify_inputs(self, drafts: torch.Tensor, lengths: torch.Tensor | None, confidences: torch.Tensor,
                      caps: torch.Tensor, slots: torch.Tensor, request_bucket: int,
                      draft_rows: int = -1) -> dict[str, torch.Tensor]:
        """Fixed-shape inputs for a key of ``request_bucket``. Empty bucket slots sit on the scratch slot
        with cap and length -1 (no row at all: not even an anchor), so every step of a key has the same
        shapes. ``lengths`` None: the key splits ``draft_rows`` (>= 0) itself with the allocate kernel.
        An input already padded to the bucket (the step builds slots and caps that way) is taken as it
        is; a padded entry sits on the scratch slot with cap -1, so its drafts, confidences and length
        are never read."""
        if lengths is None:
            lengths = torch.zeros_like(caps)
        return {"drafts": pad_to(drafts, request_bucket, 0),
                "lengths": pad_to(lengths, request_bucket, -1),
                "confidences": pad_to(confidences.float(), request_bucket, 0),
                "caps": pad_to(caps, request_bucket, -1),
                "draft_rows": torch.full((), draft_rows, dtype=torch.int64, device=slots.device),
                "slot_ids": pad_to(slots, request_bucket, self.scratch_slot)}

    @staticmethod
    def writes_context(request_bucket: int, target_rows: int) -> bool:
        """Whether a verify key writes its rows into the draft's context itself: a tier that verifies
        drafted rows does; the bucket's own tier queues them instead on draft-off steps (see
        :meth:`context_write_now` for drafted ones)."""
        return target_rows > request_bucket

    def context_write_now(self, request_bucket: int, target_rows: int, drafted: bool) -> bool:
        """Whether this step's verify writes its rows into the draft's context inside the key.

        Every drafted tier does. The bucket's own tier does on a step whose proposal ran and left
        nothing queued (the rows are then written in order, and the next step drafts from them); a
        draft-off step queues them, since the draft may stay off and never need them."""
        if self.writes_context(request_bucket, target_rows):
            return True
        return drafted and self.draft_context is not None and self.draft_context.rows == 0

    @property
    def forwards_live_rows(self) -> bool:
        """Whether a verify forward leaves out the tier rows no live request uses (see ``_verify_fn``):
        where its keys run eagerly, i.e. with no graph backend or one that records no device graphs."""
        return self.graphs is None or not self.graphs.records

    def _verify_fn(self, drafts: torch.Tensor, lengths: torch.Tensor, confidences: torch.Tensor, caps: torch.Tensor,
                   draft_rows: torch.Tensor, slot_ids: torch.Tensor, *, target_rows: int,
                   write_context: bool) -> tuple[torch.Tensor, ...]:
        """Everything from the budget split on, as one key: the split (the allocate kernel, when
        ``draft_rows`` >= 0), pack the tier's rows from slot storage, run the target, accept greedy
        prefixes, write the rows into the draft's context (``write_context``) and commit to slot
        storage. Outputs: accepted, committed, verify lengths, the packed rows (tokens, positions,
        slots, offsets), the host result (:func:`~dspark_core.engine.step.collect`) and, when the context
        is not written here, the target's hidden states."""
        if self.draft is not None and static_shapes_active():
            # a recorded graph cannot branch on the flag: computed on every replay, chosen by it
            allocated = self.kernels.allocate(confidences, caps, draft_rows)
            lengths = torch.where(draft_rows >= 0, allocated, lengths)
        elif self.draft is not None and (rows := int(draft_rows)) >= 0:  # eager: only when asked (free on a CPU)
            lengths = self.kernels.allocate(confidences, caps, rows)
        lengths = torch.where(caps < 0, -1, lengths)  # empty bucket entries: no row
        # A tier of G rows holds one anchor per bucket entry and G - B drafted rows: no request verifies
        # more (every shipped split already keeps within it; a plugin's is cut here, which stays exact).
        # The bound lets a captured forward size attention for min(K, G - B) + 1 rows per request.
        spare = max(target_rows - slot_ids.shape[0], 0)
        if spare < self.draft_width:
            lengths = lengths.clamp(max=spare)
        anchors, starts = self.storage.anchors(slot_ids)
        packed = self.kernels.pack(anchors, drafts, lengths, starts, slot_ids, target_rows, self.scratch_slot)
        # one more request, on the scratch slot, holds the tier's padding rows. A live request has its
        # anchor and at most min(K, G - B) drafted rows, so a captured forward sizes attention for that
        # many rows per request instead of the tier's G (16 requests at full width: 16 times fewer
        # scores; target-only at 16 requests: one row each, not 16). Nothing reads the padding request's
        # results, so a captured forward leaves it out of attention (padding_last)
        # eager, the padding rows are left out (a host read, as the pack kernel's check already made): at
        # partial occupancy they are most of the tier (9 requests in bucket 16 computed 16 rows; on the
        # development CPU a forward of 9 rows took 71 ms, of 9 plus 7 padding rows 101 ms)
        forwarded = target_rows if static_shapes_active() else int(packed.row_offsets[-1])
        trimmed = 0 < forwarded < target_rows  # (a key's warmup on an empty bucket has only padding rows)
        if trimmed:
            slots, offsets = slot_ids, packed.row_offsets
        else:
            forwarded = target_rows
            slots = torch.cat([slot_ids, self._scratch_slot_id])
            offsets = torch.cat([packed.row_offsets, packed.row_offsets.new_full((1,), target_rows)])
        batch = ForwardBatch(packed.tokens[:forwarded], packed.positions[:forwarded], slots, offsets,
                             padding_slot=self.scratch_slot, max_request_rows=min(self.draft_width, spare) + 1,
                             padding_last=not trimmed)
        out = self.forward(batch, greedy_only=True)
        # (a request's cells past its rows read some other row, clamped into the forwarded ones: junk, never accepted)
        grid = gather_target_tokens(_greedy(out), packed.row_offsets, self.draft_width)
        acceptance = self.kernels.accept(drafts, lengths, grid)
        if write_context and out.hidden is not None and self.draft is not None:
            # the draft's context learns the target's view of every row. Rejected rows sit past the
            # new anchor and are overwritten before they are ever attended; padding rows sit on the
            # scratch slot, which no proposal reads. The queue was flushed by this step's proposal,
            # so writing now keeps the rows in order
            self.draft.extend_context(out.hidden, packed.positions[:forwarded], packed.row_slots[:forwarded])
        self.storage.commit(slot_ids, acceptance)
        # what the host reads of the step, packed here so that reading it is one copy and no op outside the key
        host_result = pack_host_result(acceptance, lengths, confidences)
        outputs = (acceptance.accepted, acceptance.committed, lengths, packed.tokens, packed.positions,
                   packed.row_slots, packed.row_offsets, host_result)
        return outputs if write_context or out.hidden is None else (*outputs, out.hidden)

    def verify_commit(self, drafts: torch.Tensor, lengths: torch.Tensor | None, slots: torch.Tensor,
                      request_bucket: int, target_rows: int, *, confidences: torch.Tensor, caps: torch.Tensor,
                      draft_rows: int = -1, queue_context: bool = True, live: int | None = None,
                      drafted: bool = False, kv_span: int = 0) -> tuple[PackedRows, Acceptance, torch.Tensor, torch.Tensor]:
        """Verify ``lengths[r]`` drafted tokens of every request in a tier of ``target_rows`` rows and
        commit; with ``lengths`` None, split ``draft_rows`` among the requests by ``confidences`` and
        ``caps`` first (the allocate kernel). Returns the packed rows, the acceptance, the lengths and
        the step's host result ([n, 2 + (K+1) + K] float64: accepted, length, committed tokens,
        confidences), all computed inside the key.

        Runs as the (bucket, rows) key of the graph backend, or eagerly on the same padded inputs without
        one. A drafted tier (more rows than the bucket) writes the draft's context inside the key, and so
        does the bucket's own tier on a ``drafted`` step (the proposal ran and nothing is queued); on a
        draft-off step it queues its rows, which are written only if the draft runs again, and only with
        ``queue_context`` (False for a policy that never drafts). Any input may come
        already padded to the bucket; ``live`` then says how many requests are real (by default as many
        as ``slots`` has entries). ``kv_span`` picks the key prepared for that span (:meth:`span_for`):
        every position the step touches must be below it.
        """
        if lengths is None and (draft_rows < 0 or self.draft is None):
            raise ValueError("verify_commit: a split inside the key needs a draft and draft_rows >= 0")
        inputs = self.verify_inputs(drafts, lengths, confidences, caps, slots, request_bucket,
                                    draft_rows if lengths is None else -1)
        write_context = self.context_write_now(request_bucket, target_rows, drafted)
        if self.graphs is not None:
            outputs = self.graphs.run(self.binding_key(request_bucket, target_rows, write_context, kv_span), inputs)
        else:
            outputs = self._verify_fn(**inputs, target_rows=target_rows, write_context=write_context)
        accepted, committed, verified, tokens, positions, row_slots, row_offsets, host_result = outputs[:8]
        if len(outputs) > 8 and queue_context and self.draft_context is not None:
            hidden = outputs[8]  # the forwarded rows: eagerly the live ones only, the tier's padding left out
            self.extend_draft_context(hidden, positions[: hidden.shape[0]], row_slots[: hidden.shape[0]])
        n = slots.shape[0] if live is None else live
        return (PackedRows(tokens, positions, row_slots, row_offsets[: n + 1]),
                Acceptance(accepted[:n], committed[:n]), verified[:n], host_result[:n])

    def warmup(self, geometry: Geometry) -> None:
        """Prepare every bucket's proposal key (with a draft) and every (bucket, tier) verify key (split,
        verify, accept, commit), each for the whole cache and every KV span; writes touch only the
        scratch slot."""
        if self.graphs is None:
            return
        as_long = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)  # noqa: E731
        spans = (0, *self.kv_spans)
        for bucket in geometry.request_buckets:
            if self.draft is not None:
                scratch = {"slot_ids": as_long([self.scratch_slot] * bucket)}
                # a bucket with a draft depth also keeps a key for all K (a fixed k above the depth)
                for depth in sorted({self.draft_width, self.draft_depths.get(bucket, self.draft_width)}):
                    for copies in (False, True) if self.copy_orders else (False,):
                        for span in spans:
                            self.graphs.prepare(self.proposal_key(bucket, copies, span, depth),
                                                partial(self._propose_fn, copies=copies, depth=depth), scratch)
                if self.copy_orders:
                    self.graphs.prepare(self.copy_key(bucket), self._copy_fn, scratch)
            no_requests = torch.zeros(0, self.draft_width, device=self.device)
            example = self.verify_inputs(no_requests.long(), as_long([]), no_requests, as_long([]), as_long([]), bucket)
            for rows in geometry.rows_for(bucket):
                # the bucket's own tier also gets the variant that writes the draft's context (drafted steps)
                variants = (False, True) if rows == bucket and self.draft is not None else (self.writes_context(bucket, rows),)
                for write in variants:
                    fn = partial(self._verify_fn, target_rows=rows, write_context=write)
                    for span in spans:
                        self.graphs.prepare(self.binding_key(bucket, rows, write, span), fn, example)


def checked_draft_depths(draft: DraftModel | None, depths: Mapping[int, int], width: int) -> dict[int, int]:
    """``depths`` (request bucket -> tokens proposed there) without the buckets that propose all K,
    after checking that every depth lies in 1..K and that the draft can propose fewer than K."""
    bad = {bucket: depth for bucket, depth in depths.items() if not 1 <= depth <= width}
    if bad:
        raise ConfigError(f"draft depths {bad}: each must lie in 1..{width} (num_speculative_tokens)")
    short = {int(bucket): int(depth) for bucket, depth in depths.items() if depth < width}
    if short and draft is not None and not _takes_keyword(draft.propose, "depth"):
        raise ConfigError(f"draft depths {short}: this draft ({type(draft).__name__}) proposes only whole blocks "
                          "(its propose() takes no depth); use --draft_depths=full")
    return short


def _takes_keyword(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: assume not
        return False


def _takes_greedy_only(target: TargetModel) -> bool:
    return _takes_keyword(target.forward, "greedy_only")  # a target written before the option: the plain call


def _greedy(out: ForwardOutput) -> torch.Tensor:
    """The greedy tokens of a target forward: its own when it gave them, else ``argmax`` of its logits."""
    return out.tokens if out.tokens is not None else greedy_tokens(out.full_logits())


def pad_to(values: torch.Tensor, rows: int, fill: int) -> torch.Tensor:
    """``values`` with rows of ``fill`` appended up to ``rows`` (``values`` itself when it has them)."""
    extra = rows - values.shape[0]
    if extra == 0:
        return values
    return torch.cat([values, values.new_full((extra, *values.shape[1:]), fill)])


def pack_host_result(acceptance: Acceptance, lengths: torch.Tensor, confidences: torch.Tensor) -> torch.Tensor:
    """What the host reads of a step as one float64 tensor [n, 2 + (K+1) + K]: accepted count, verify
    length, committed tokens, confidences (token ids and counts are exact in float64)."""
    counts = torch.cat([acceptance.accepted.unsqueeze(1), lengths.unsqueeze(1), acceptance.committed], dim=1)
    # the integer columns are joined first, so they take one conversion (a device kernel each) instead of three
    return torch.cat([counts.to(torch.float64), confidences.to(torch.float64)], dim=1)

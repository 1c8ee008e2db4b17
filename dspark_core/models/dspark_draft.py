"""DSpark draft: a parallel block drafter with KV injection, Markov head and confidence head.

How one block is drafted for a request whose last committed token (the
*anchor*) sits at position ``p``:

* the input block is ``[anchor, mask, ..., mask]`` at positions ``p .. p+S-1``
  (``S`` = block_size); it runs through a few **non-causal** layers once;
* each layer's attention also sees keys/values computed from the target's
  hidden states at positions ``< p`` (the *context*), projected by ``fc`` and
  ``hidden_norm`` and written into a per-slot context cache by
  :meth:`DSparkDraft.extend_context`. Rows the target rejected sit at positions
  ``>= p``: never attended, overwritten later, so no rollback is needed;
* proposal ``j`` (``j = 0..K-1``) predicts the token at ``p+j+1``. Its logits
  are the backbone logits plus a Markov bias from the token at ``p+j`` (the
  anchor for ``j = 0``, else proposal ``j-1``), chosen greedily in a short
  sequential loop; its confidence is ``sigmoid(head([h; W1[prev]]) / T_j)``.

Inside :func:`dspark_core.graphs.static_shapes` (what a captured graph backend
turns on while it records, the same switch the targets follow) the backbone
reads each slot's whole context cache and masks it by position instead of
sizing the read from the largest anchor position: no host read, shapes fixed
by the batch and the cache, the eager proposal up to rounding.

Eager proposals (without gradients) whose slots fill a run of the context
cache no longer than the batch (an engine's largest bucket) are computed in
that run's slot order, and attention reads the context in place instead of
gathering it (:mod:`dspark_core.models.context_cells`); ``padding_slot`` (the
engine sets its scratch slot) marks the entries whose proposals are never read.

The token embedding and LM head belong to the target (:meth:`bind_target`)
and are never stored with the draft unless a checkpoint brings its own
draft-vocabulary ``lm_head``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import frozen
from torch import nn

from dspark_core.errors import ModelError
from dspark_core.graphs import static_kv_length, static_shapes_active
from dspark_core.models.draft_config import DraftConfig
from dspark_core.models.draft_heads import ConfidenceHead, MarkovHead
from dspark_core.models.draft_layers import DraftLayer, RMSNorm, project
from dspark_core.models.kv_cache import KVCache
from dspark_core.models.attention import context_block_attention
from dspark_core.models.context_cells import ContextCells
from dspark_core.models.layers import apply_rope, greedy_tokens, linear, rope_constants, rope_cos_sin


@frozen
class BlockOutput:
    """Teacher-forced block outputs for training: one entry per proposed position."""

    logits: torch.Tensor  # [N, K, draft_vocab] (backbone + Markov bias)
    confidence_logits: torch.Tensor | None  # [N, K], before STS temperatures
    hidden: torch.Tensor  # [N, K, d] final-norm hidden states


class DSparkDraft(nn.Module):
    """The draft model; parameter names match speculators ``dspark`` checkpoints."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(len(c.aux_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.markov_head = MarkovHead(c.target_vocab_size, c.draft_vocab_size, c.markov_rank, c.hidden_size, c.markov_head_type) if c.markov_rank > 0 else None
        conf_in = c.hidden_size + (c.markov_rank if c.confidence_head_with_markov else 0)
        self.confidence_head = ConfidenceHead(conf_in) if c.enable_confidence_head else None
        self.lm_head: nn.Parameter | None = None  # only when a checkpoint carries its own
        subset = c.draft_vocab_size < c.target_vocab_size
        # d2t holds offsets: target id = draft id + d2t[draft id] (speculators convention).
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long) if subset else None)
        self.register_buffer("t2d", torch.zeros(c.target_vocab_size, dtype=torch.bool) if subset else None)
        self.register_buffer("temperatures", torch.tensor(c.temperatures, dtype=torch.float32), persistent=False)
        self.context: KVCache | None = None
        # the context slot of padding entries, whose proposals nobody reads (the engine's scratch slot):
        # with it, an eager proposal may read the context in place (context_cells)
        self.padding_slot: int | None = None
        self._rope_constants: tuple[torch.Tensor, torch.Tensor] | None = None  # with the context
        self._embed: torch.Tensor | None = None
        self._head: torch.Tensor | None = None

    # -- wiring ------------------------------------------------------------------

    def draft_to_target(self) -> torch.Tensor:
        """Target token id of every draft-vocabulary entry."""
        ids = torch.arange(self.config.draft_vocab_size, device=self.fc.weight.device)
        return ids if self.d2t is None else ids + self.d2t

    def bind_target(self, target) -> DSparkDraft:
        """Share the target's embedding and LM head (restricted to the draft vocabulary)."""
        c = self.config
        if target.config.hidden_size != c.hidden_size or target.config.vocab_size != c.target_vocab_size:
            raise ModelError(f"draft (hidden {c.hidden_size}, vocab {c.target_vocab_size}) does not fit target (hidden {target.config.hidden_size}, vocab {target.config.vocab_size})")
        bad = [i for i in c.aux_layer_ids if not 0 <= i <= target.config.num_layers]
        if bad:
            raise ModelError(f"draft aux_hidden_state_layer_ids {bad} are outside the target's 0..{target.config.num_layers}")
        self._embed = target.embed.detach()
        head = target.lm_head.detach()
        head = head if self.d2t is None else head[self.draft_to_target()]
        self._head = head.to(self.fc.weight.dtype)  # a draft may compute in a narrower dtype than its target
        return self

    def allocate_context(self, num_slots: int, max_len: int) -> KVCache:
        """Allocate the per-slot context cache (keys/values derived from target hidden states)."""
        c = self.config
        p = self.fc.weight
        self.context = KVCache.allocate(c.num_layers, num_slots, max_len, c.num_kv_heads, c.head_dim, dtype=p.dtype, device=p.device)
        self.padding_slot = None  # a new context: its owner says again which slot is padding
        # made here, on the draft's device, before any forward (and so before any graph capture)
        self._rope_constants = rope_constants(c.head_dim, c.rope_theta, p.device)
        return self.context

    def _ready(self) -> None:
        if self._embed is None:
            raise ModelError("draft is not bound to a target: call bind_target(target) first")
        if self.context is None:
            raise ModelError("draft has no context cache: call allocate_context(num_slots, max_len) first")

    # -- context -----------------------------------------------------------------

    def extend_context(self, hidden: torch.Tensor, positions: torch.Tensor, slot_of_row: torch.Tensor) -> None:
        """Write draft K/V for target rows: ``hidden [G, n_aux*d]`` at ``positions [G]`` of ``slot_of_row [G]``."""
        self._ready()
        c = self.config
        with torch.no_grad():
            ctx = self.hidden_norm(project(self.fc, hidden.to(self.fc.weight.dtype)))
            cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, ctx.dtype, self._rope_constants)
            for i, layer in enumerate(self.layers):
                a = layer.self_attn
                k = a.k_norm(project(a.k_proj, ctx).view(-1, c.num_kv_heads, c.head_dim))
                v = project(a.v_proj, ctx).view(-1, c.num_kv_heads, c.head_dim)
                self.context.write(i, slot_of_row, positions, apply_rope(k, cos, sin), v)

    # -- backbone ----------------------------------------------------------------

    def backbone(self, anchor_tokens: torch.Tensor, anchor_positions: torch.Tensor, slot_ids: torch.Tensor,
                 block_rows: int | None = None) -> torch.Tensor:
        """Final-norm hidden states ``[N, S, d]`` of the blocks ``[anchor, mask...]`` (``S``: ``block_rows``,
        by default the trained ``block_size``; a shorter block is the trained one cut after ``S`` slots)."""
        self._ready()
        c = self.config
        s = c.block_size if block_rows is None else block_rows
        context = self.context
        if static_shapes_active():
            # graph capture: read every slot's whole context cache (or the key's span of it), the mask
            # hides positions >= anchor; no host read and a key length fixed by the key, with the eager result
            ctx_len = static_kv_length(context.max_len)
            cells = None  # (a gather: see context_cells for why captured proposals keep it)
        else:
            # the one host read: context keys are positions < anchor, and the slots decide the cells
            host = torch.cat([anchor_positions.max()[None], slot_ids.to(anchor_positions.device)]).tolist()
            ctx_len = host[0]
            if ctx_len > context.max_len:
                raise ModelError(f"draft context cache holds {context.max_len} positions; anchor position {ctx_len} does not fit")
            # proposals only (no gradients): a training forward keeps its gathered copy, since an in-place
            # read would tie its backward pass to a cache that later writes change
            cells = None if torch.is_grad_enabled() else ContextCells.eager(host[1:], self.padding_slot,
                                                                             slot_ids.device)
        reorder = cells is not None and cells.entry_of_cell is not None
        if reorder:  # blocks by slot: the context is read in place (context_cells)
            anchor_tokens = anchor_tokens[cells.entry_of_cell]
            anchor_positions = torch.where(cells.holds_entry, anchor_positions[cells.entry_of_cell], 0)
        n = anchor_tokens.shape[0]
        ids = torch.full((n, s), c.mask_token_id, dtype=torch.long, device=anchor_tokens.device)
        ids[:, 0] = anchor_tokens
        x = self._embed[ids].to(self.fc.weight.dtype)
        positions = (anchor_positions[:, None] + torch.arange(s, device=ids.device)).reshape(-1)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype, self._rope_constants)
        sees_context = torch.arange(ctx_len, device=ids.device)[None, :] < anchor_positions[:, None]
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x).reshape(n * s, -1)
            q = apply_rope(a.q_norm(project(a.q_proj, h).view(n * s, c.num_heads, c.head_dim)), cos, sin)
            k = apply_rope(a.k_norm(project(a.k_proj, h).view(n * s, c.num_kv_heads, c.head_dim)), cos, sin)
            v = project(a.v_proj, h).view(n * s, c.num_kv_heads, c.head_dim)
            if cells is None:
                ctx_k, ctx_v = context.read(i, slot_ids, ctx_len)
            else:
                ctx_k, ctx_v = context.window(i, cells.first_slot, cells.count, ctx_len)
            block = (k.view(n, s, -1, c.head_dim).transpose(1, 2), v.view(n, s, -1, c.head_dim).transpose(1, 2))
            q = q.view(n, s, c.num_heads, c.head_dim).transpose(1, 2)
            out = context_block_attention(q, (ctx_k.to(k.dtype), ctx_v.to(v.dtype)), block, sees_context)
            x = x + project(a.o_proj, out.transpose(1, 2).reshape(n, s, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self.norm(x)
        return x[cells.cell_of_entry] if reorder else x

    def _proposal_hidden(self, anchor_tokens, anchor_positions, slot_ids, depth: int | None = None) -> torch.Tensor:
        first, width = self.config.first_proposal_slot, self.config.num_speculative_tokens
        depth = width if depth is None else depth
        if not 1 <= depth <= width:
            raise ModelError(f"draft depth {depth} is outside 1..{width} (the tokens this draft proposes per block)")
        block_rows = None if depth == width else first + depth
        return self.backbone(anchor_tokens, anchor_positions, slot_ids, block_rows)[:, first : first + depth]

    def _head_weight(self) -> torch.Tensor:
        return self.lm_head if self.lm_head is not None else self._head

    def _confidence_logit(self, hidden: torch.Tensor, prev_emb: torch.Tensor | None) -> torch.Tensor:
        feats = torch.cat([hidden, prev_emb], dim=-1) if self.config.confidence_head_with_markov else hidden
        return self.confidence_head(feats)

    def confidence(self, confidence_logits: torch.Tensor) -> torch.Tensor:
        """Calibrated confidences ``sigmoid(logit_j / T_j)`` for ``[..., K]`` logits (or the first
        positions' ``[..., depth]``)."""
        return torch.sigmoid(confidence_logits.float() / self.temperatures[: confidence_logits.shape[-1]])

    # -- inference ---------------------------------------------------------------

    @torch.no_grad()
    def propose(self, anchor_tokens: torch.Tensor, anchor_positions: torch.Tensor, slot_ids: torch.Tensor,
                depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy block for each request: target-vocabulary tokens ``[B, K]`` and confidences ``[B, K]``.
        Drafts without a confidence head report confidence 1.0 everywhere.

        ``depth`` (1..K, default K) proposes only the first ``depth`` tokens, from a block cut after
        them: the block is non-causal, so its first tokens change a little, but on held-out SmolLM2
        answers their acceptance did not (docs/architecture.md, "Draft depth"). The remaining
        ``K - depth`` positions come back as token 0 with confidence 0, which no budget selects.
        """
        c = self.config
        hidden = self._proposal_hidden(anchor_tokens, anchor_positions, slot_ids, depth)
        depth = hidden.shape[1]
        base = linear(hidden, self._head_weight()).float()  # [B, K, V_draft]
        to_target = self.draft_to_target()
        head = self.markov_head
        if head is None:  # no token feeds the next position: the whole block in one argmax
            out_tokens, prev_emb = to_target[greedy_tokens(base)], None
        else:
            # only the greedy chain is sequential (position j's bias needs token j-1); the confidence
            # head then runs once for the block, since on the CPU a step is bound by per-op overhead
            prev, state, tokens, embs = anchor_tokens, head.initial_state(anchor_tokens.shape[0], hidden), [], []
            for j in range(depth):
                embs.append(head.markov_w1(prev))
                bias, state = head.step(embs[-1], hidden[:, j], state)
                prev = to_target[greedy_tokens(base[:, j] + bias)]  # float32 + the bias, promoted
                tokens.append(prev)
            out_tokens, prev_emb = torch.stack(tokens, dim=1), torch.stack(embs, dim=1)
        if self.confidence_head is None:
            confidences = torch.ones(out_tokens.shape, dtype=torch.float32, device=out_tokens.device)
        else:
            confidences = self.confidence(self._confidence_logit(hidden, prev_emb))
        missing = c.num_speculative_tokens - depth
        if missing:  # positions past the depth: nothing proposed, nothing to verify
            out_tokens, confidences = F.pad(out_tokens, (0, missing)), F.pad(confidences, (0, missing))
        return out_tokens, confidences

    # -- training ----------------------------------------------------------------

    def forward_block(self, prev_tokens: torch.Tensor, anchor_positions: torch.Tensor, slot_ids: torch.Tensor) -> BlockOutput:
        """Teacher-forced block outputs (differentiable).

        ``prev_tokens [N, K]`` holds the true tokens at positions ``p .. p+K-1``
        (column 0 is the anchor); proposal ``j`` is scored against the token at
        ``p+j+1``. The backbone still sees ``[anchor, mask...]``, exactly as in
        :meth:`propose`; teacher forcing only feeds the Markov and confidence heads.
        """
        hidden = self._proposal_hidden(prev_tokens[:, 0], anchor_positions, slot_ids)
        logits = F.linear(hidden, self._head_weight()).float()
        prev_emb = None
        if self.markov_head is not None:
            prev_emb = self.markov_head.markov_w1(prev_tokens)
            logits = logits + self.markov_head.block_bias(prev_tokens, hidden).float()
        conf = self._confidence_logit(hidden, prev_emb) if self.confidence_head is not None else None
        return BlockOutput(logits, conf, hidden)

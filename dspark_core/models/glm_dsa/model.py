"""The GLM-DSA target: MLA + lightning-indexer sparse attention + MoE, on packed rows.

It follows the same contract as :class:`dspark_core.models.llama.LlamaTarget`
(see :class:`dspark_core.models.base.TargetModel`): rows of several requests
are packed back to back; each layer first writes every row's cache entries
(latent, rotary key and, in indexer layers, the indexer key) at (slot,
position) and only then attends, so a row sees its own and all earlier rows
of its request. Hidden-state index ``i`` is the residual stream after ``i``
layers (0 = embeddings), which is what a DSpark draft injects.

Every op is plain torch (no CUDA-only code), which is what the NPU's
``npu_kernel_backend=TORCH`` asks for: torch_npu runs these ops on Ascend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dspark_core.errors import ModelError
from dspark_core.models.base import ForwardBatch, ForwardOutput
from dspark_core.models.glm_dsa.attention import LatentAttention
from dspark_core.models.glm_dsa.cache import GlmDsaCache
from dspark_core.models.glm_dsa.config import GlmDsaConfig
from dspark_core.models.glm_dsa.moe import DenseMlp, MoeBlock
from dspark_core.models.glm_dsa.static import PerRow, static_shapes_active
from dspark_core.models.glm_dsa.weights import Weights
from dspark_core.models.layers import greedy_tokens, rms_norm, rope_cos_sin
from dspark_core.models.row_layout import RowLayout


class GlmDsaLayer(nn.Module):
    """One decoder layer: pre-norm MLA (+ indexer) and pre-norm dense or MoE feed-forward."""

    def __init__(self, cfg: GlmDsaConfig, weights: Weights, index: int) -> None:
        super().__init__()
        p = f"model.layers.{index}."
        d = cfg.hidden_size
        self.input_norm = weights.param(p + "input_layernorm.weight", (d,))
        self.post_norm = weights.param(p + "post_attention_layernorm.weight", (d,))
        self.attn = LatentAttention(cfg, weights, p + "self_attn.", with_indexer=cfg.indexer_types[index] == "full")
        if cfg.mlp_layer_types[index] == "sparse":
            self.mlp: nn.Module = MoeBlock(cfg, weights, p + "mlp.")
        else:
            self.mlp = DenseMlp(weights, p + "mlp.", cfg.intermediate_size, d)


class RowPlan(NamedTuple):
    """Row bookkeeping of one forward: eager (padded per request) or static (each row alone)."""

    grouping: object  # .pad([G, ...]) -> [groups, rows, ...] and .unpad back
    slot_of_row: torch.Tensor  # [G]
    key_slots: torch.Tensor  # slot whose indexer keys each group reads
    visible: torch.Tensor  # bool [groups, rows, L]: key position <= the row's own
    length: int  # cache positions scanned (L)


class GlmDsaTarget(nn.Module):
    """The target model. ``config`` is a :class:`GlmDsaConfig` (it has every field the engine reads).

    ``static_shapes`` pins the forward to static-shape mode (see
    :mod:`dspark_core.models.glm_dsa.static`); by default only graph capture uses it.
    """

    static_shapes = False

    def __init__(self, config: GlmDsaConfig, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tokenizer=None) -> None:
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.device = torch.device(device)
        cfg = config
        weights = Weights(tensors, dtype, device)
        self.embed = weights.param("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(GlmDsaLayer(cfg, weights, i) for i in range(cfg.num_layers))
        self.final_norm = weights.param("model.norm.weight", (cfg.hidden_size,))
        self.lm_head = self.embed if cfg.tie_embeddings else weights.param("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
        #: layer -> row of the cache's indexer keys (only layers with their own indexer have one)
        self.index_rows = {layer: row for row, layer in enumerate(cfg.full_indexer_layers)}

    # -- cache -----------------------------------------------------------------

    def new_cache(self, num_slots: int, max_len: int) -> GlmDsaCache:
        """Allocate a static cache of ``num_slots`` x ``max_len`` positions."""
        c = self.config
        if max_len > c.max_position:
            raise ModelError(f"requested KV length {max_len} exceeds the model context limit {c.max_position}")
        return GlmDsaCache.allocate(c.num_layers, len(self.index_rows), num_slots, max_len, kv_lora_rank=c.kv_lora_rank,
                                    rope_dim=c.qk_rope_head_dim, index_head_dim=c.index_head_dim, dtype=self.dtype,
                                    device=self.device)

    # -- forward ---------------------------------------------------------------

    def check_hidden_layers(self, hidden_layers: tuple[int, ...]) -> None:
        """Hidden-state index i is the residual stream after i decoder layers (0 = embeddings)."""
        for i in hidden_layers:
            if not 0 <= i <= self.config.num_layers:
                raise ModelError(f"hidden layer index {i} is outside 0..{self.config.num_layers}")

    def logits_from_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head, float32 logits."""
        return F.linear(rms_norm(x, self.final_norm, self.config.rms_eps), self.lm_head).float()

    def plan(self, batch: ForwardBatch, cache: GlmDsaCache) -> RowPlan:
        """How rows are grouped for the indexer and how many cache positions they scan."""
        if self.static_shapes or static_shapes_active():
            counts = batch.row_offsets[1:] - batch.row_offsets[:-1]
            slot_of_row = torch.repeat_interleave(batch.slot_ids, counts, output_size=batch.tokens.shape[0])
            length = cache.max_len  # positions are trusted to fit: checking would need a host read
            key_pos = torch.arange(length, device=batch.positions.device)
            visible = (key_pos[None, :] <= batch.positions[:, None])[:, None, :]  # [G, 1, L]
            return RowPlan(PerRow(), slot_of_row, slot_of_row, visible, length)
        layout = RowLayout.build(batch.positions, batch.slot_ids, batch.row_offsets)
        cache.check_fits(layout.kv_len - 1)
        return RowPlan(layout, layout.slot_of_row, batch.slot_ids, layout.causal_mask()[:, 0], layout.kv_len)

    def attention(self, i: int, h: torch.Tensor, batch: ForwardBatch, plan: RowPlan, cache: GlmDsaCache,
                  cos: torch.Tensor, sin: torch.Tensor, selected: torch.Tensor | None):
        """Layer ``i``'s attention output and the selection it used (a shared layer reuses ``selected``)."""
        attn = self.layers[i].attn
        q_latent, q_nope, q_pe, latent, k_pe = attn.project(h, cos, sin)
        # Write first, then read: the rows see their own and earlier rows' entries.
        cache.write(i, plan.slot_of_row, batch.positions, latent, k_pe)
        if attn.indexer is not None:
            row = self.index_rows[i]
            cache.write_index(row, plan.slot_of_row, batch.positions, attn.indexer.keys(h, cos, sin))
            keys = cache.read_index(row, plan.key_slots, plan.length)
            selected = attn.indexer.select(h, q_latent, cos, sin, keys, plan.grouping, plan.visible)
        return attn.attend(q_nope, q_pe, cache, i, plan.slot_of_row, batch.positions, selected), selected

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: GlmDsaCache, hidden_layers: tuple[int, ...] = (),
                logit_rows: torch.Tensor | None = None, greedy_only: bool = False) -> ForwardOutput:
        """Write every row's cache entries at (slot, position), then attend to its slot's selected
        positions; logits of ``logit_rows`` only when given (and with ``greedy_only`` their greedy
        tokens too: this model computes the logits either way)."""
        logits, hidden = self.forward_tensors(batch, cache, hidden_layers, logit_rows)
        return ForwardOutput(logits, hidden, greedy_tokens(logits) if greedy_only else None)

    def forward_tensors(self, batch: ForwardBatch, cache: GlmDsaCache, hidden_layers: tuple[int, ...] = (),
                        logit_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` as a plain ``(logits, hidden)`` tuple (what a graph tracer can follow)."""
        c = self.config
        self.check_hidden_layers(hidden_layers)
        plan = self.plan(batch, cache)
        dense_experts = self.static_shapes or static_shapes_active()
        cos, sin = rope_cos_sin(batch.positions, c.qk_rope_head_dim, c.rope_theta, self.dtype)
        x = self.embed[batch.tokens]
        saved = {0: x} if 0 in hidden_layers else {}
        selected = None
        for i, layer in enumerate(self.layers):
            out, selected = self.attention(i, rms_norm(x, layer.input_norm, c.rms_eps), batch, plan, cache, cos, sin,
                                           selected)
            x = x + out
            h = rms_norm(x, layer.post_norm, c.rms_eps)
            x = x + (layer.mlp(h, dense=dense_experts) if isinstance(layer.mlp, MoeBlock) else layer.mlp(h))
            if i + 1 in hidden_layers:
                saved[i + 1] = x
        hidden = torch.cat([saved[i] for i in hidden_layers], dim=-1) if hidden_layers else None
        return self.logits_from_hidden(x if logit_rows is None else x[logit_rows]), hidden

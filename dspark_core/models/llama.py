"""Llama-architecture target (SmolLM2, Llama, Qwen2/3 dense) written directly in torch.

Weights arrive as a dict with Hugging Face names (``model.layers.0.self_attn.q_proj.weight``
...) whatever the file format; the loaders translate GGUF names into these.
At construction q/k/v and gate/up are fused so one forward issues fewer, larger
matrix products.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from attrs import evolve
from torch import nn

from dspark_core.errors import ModelError
from dspark_core.graphs import static_kv_length, static_shapes_active
from dspark_core.models import greedy_head
from dspark_core.models.base import ForwardBatch, ForwardOutput, TargetConfig
from dspark_core.models.greedy_head import GreedyHead
from dspark_core.models.kv_cache import KVCache
from dspark_core.models.row_bands import plan_bands
from dspark_core.models.row_cells import OneRowCells, attend_cells
from dspark_core.models.attention import attend, grouped_mask, invariant_cache_length, invariant_kv_length
from dspark_core.models.layers import (apply_rope, apply_rope_, greedy_tokens, invariant_linear, linear, products_rows_invariant,
                                      residual_linear, rms_norm, rope_constants, rope_cos_sin,
                                      swiglu_activation)
from dspark_core.models.row_layout import RowLayout, static_window_pays, window_cells


def batch_invariant_default(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a target on ``device`` in ``dtype`` runs batch-invariant forwards by default.

    On the CPU they are on in float32, bfloat16 and float16 wherever this CPU's matrix products in
    that dtype measured row-invariant (:func:`~dspark_core.models.layers.products_rows_invariant`;
    float16 did not on the development CPU, which has no native float16 products). Without them a
    verify row and the target-only row at the same position differ in the last bits (float32: up
    to 6e-5 on SmolLM2, so greedy output may part at a near-tie; bfloat16: a rounding step of the
    8-bit mantissa, and greedy output parted on 22 of 24 prompts). They cost 2-4 % of a float32
    step up to 4 rows per request and 9-12 % at full width (benchmarks/results/amx). Float64 (test
    models) keeps the default kernels. ``serve --batch_invariant=on/off`` overrides this default
    (:meth:`LlamaTarget.set_batch_invariant`).
    """
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)
            and products_rows_invariant(dtype))


def _take(tensors: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    if name not in tensors:
        raise ModelError(f"checkpoint is missing weight {name!r}")
    t = tensors[name]
    if tuple(t.shape) != shape:
        raise ModelError(f"weight {name!r} has shape {tuple(t.shape)}, expected {shape}")
    return t.to(device=device, dtype=dtype)


class LlamaLayer(nn.Module):
    """One decoder layer; parameters only, the maths lives in :class:`LlamaTarget`."""

    def __init__(self, cfg: TargetConfig, tensors: Mapping[str, torch.Tensor], index: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        p = f"model.layers.{index}."
        d, hd = cfg.hidden_size, cfg.head_dim
        q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd

        def take(name: str, shape: tuple[int, ...]) -> nn.Parameter:
            return nn.Parameter(_take(tensors, p + name, shape, dtype, device), requires_grad=False)

        self.input_norm = take("input_layernorm.weight", (d,))
        self.post_norm = take("post_attention_layernorm.weight", (d,))
        self.qkv = nn.Parameter(torch.cat([take("self_attn.q_proj.weight", (q_out, d)), take("self_attn.k_proj.weight", (kv_out, d)), take("self_attn.v_proj.weight", (kv_out, d))]), requires_grad=False)
        self.qkv_bias = None
        if cfg.qkv_bias:
            self.qkv_bias = nn.Parameter(torch.cat([take("self_attn.q_proj.bias", (q_out,)), take("self_attn.k_proj.bias", (kv_out,)), take("self_attn.v_proj.bias", (kv_out,))]), requires_grad=False)
        self.o_proj = take("self_attn.o_proj.weight", (d, q_out))
        self.q_norm = take("self_attn.q_norm.weight", (hd,)) if cfg.qk_norm else None
        self.k_norm = take("self_attn.k_norm.weight", (hd,)) if cfg.qk_norm else None
        inter = cfg.intermediate_size
        self.gate_up = nn.Parameter(torch.cat([take("mlp.gate_proj.weight", (inter, d)), take("mlp.up_proj.weight", (inter, d))]), requires_grad=False)
        self.down = take("mlp.down_proj.weight", (d, inter))


class LlamaTarget(nn.Module):
    """The target model. See :class:`dspark_core.models.base.TargetModel` for the contract."""

    def __init__(self, config: TargetConfig, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tokenizer=None, batch_invariant: bool | None = None) -> None:
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.device = torch.device(device)
        # Batch-invariant forwards: a row's logits do not depend on the batch it is in (see
        # batch_invariant_default for when they are on).
        self.set_batch_invariant(batch_invariant_default(self.device, dtype) if batch_invariant is None else batch_invariant)
        self._rope_constants = rope_constants(config.head_dim, config.rope_theta, self.device)
        cfg = config
        self.embed = nn.Parameter(_take(tensors, "model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), dtype, device), requires_grad=False)
        self.layers = nn.ModuleList(LlamaLayer(cfg, tensors, i, dtype, device) for i in range(cfg.num_layers))
        self.final_norm = nn.Parameter(_take(tensors, "model.norm.weight", (cfg.hidden_size,), dtype, device), requires_grad=False)
        if cfg.tie_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = nn.Parameter(_take(tensors, "lm_head.weight", (cfg.vocab_size, cfg.hidden_size), dtype, device), requires_grad=False)

    def set_batch_invariant(self, on: bool) -> None:
        """Turn batch-invariant forwards on or off (``--batch_invariant``); call it before
        :meth:`new_cache`, whose layout follows the setting."""
        if on and self.device.type != "cpu":
            raise ModelError(f"batch-invariant forwards are built and checked for the CPU only, not {self.device.type}")
        self.batch_invariant = bool(on)

    # -- cache -----------------------------------------------------------------

    @property
    def head_config(self) -> TargetConfig:
        """The attention heads this instance computes (a tensor-parallel shard holds fewer)."""
        return self.config

    @property
    def _product(self):
        """The matrix product of every weight: row-count invariant in batch-invariant forwards."""
        return invariant_linear if self.batch_invariant else linear

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Combine a row-parallel layer's partial output (identity on one rank)."""
        return partial

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        """Allocate a static cache of ``num_slots`` x ``max_len`` positions."""
        c = self.config
        if max_len > c.max_position:
            raise ModelError(f"requested KV length {max_len} exceeds the model context limit {c.max_position}")
        # Batch-invariant attention computes in float32 at least: such a cache saves converting every
        # layer's keys and values on every step (bfloat16 keys convert exactly, once, when written).
        dtype = torch.promote_types(self.dtype, torch.float32) if self.batch_invariant else self.dtype
        # invariant reads stop at the cache's end: its last block must be one they are checked for
        allocated = invariant_cache_length(max_len) if self.batch_invariant else max_len
        return KVCache.allocate(c.num_layers, num_slots, max_len, self.head_config.num_kv_heads, c.head_dim,
                                dtype=dtype, device=self.device, allocated_len=allocated)

    # -- forward ---------------------------------------------------------------

    def check_hidden_layers(self, hidden_layers: tuple[int, ...]) -> None:
        """Hidden-state index i is the residual stream after i decoder layers (0 = embeddings)."""
        for i in hidden_layers:
            if not 0 <= i <= self.config.num_layers:
                raise ModelError(f"hidden layer index {i} is outside 0..{self.config.num_layers}")

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables :meth:`_qkv` takes for rows at ``positions``; build them once per forward."""
        c = self.config
        return rope_cos_sin(positions, c.head_dim, c.rope_theta, self.dtype, self._rope_constants)

    def _qkv(self, layer: LlamaLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated queries ``[N, heads, d]`` and each row's keys and values ``[N, 2, kv_heads, d]`` (the
        layout :meth:`KVCache.write_rows` stores), with the tables of :meth:`rope_tables`."""
        c = self.head_config
        n = x.shape[0]
        qkv = self._product(rms_norm(x, layer.input_norm, c.rms_eps), layer.qkv, layer.qkv_bias)
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if layer.q_norm is None:
            # one rotary pass over the query and key heads together (4 ops a layer, not 8), in place in the
            # projection's output: its key and value heads stay side by side for the cache's one write
            apply_rope_(qkv[:, : q_size + kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
            return qkv[:, :q_size].view(n, c.num_heads, c.head_dim), qkv[:, q_size:].view(n, 2, c.num_kv_heads, c.head_dim)
        q = rms_norm(qkv[:, :q_size].view(n, c.num_heads, c.head_dim), layer.q_norm, c.rms_eps)
        k = rms_norm(qkv[:, q_size : q_size + kv_size].view(n, c.num_kv_heads, c.head_dim), layer.k_norm, c.rms_eps)
        v = qkv[:, q_size + kv_size :].view(n, c.num_kv_heads, c.head_dim)
        return apply_rope(q, cos, sin), torch.stack([apply_rope(k, cos, sin), v], dim=1)

    def _mlp(self, layer: LlamaLayer, x: torch.Tensor) -> torch.Tensor:
        activation = swiglu_activation(rms_norm(x, layer.post_norm, self.config.rms_eps), layer.gate_up, self._product)
        return self._add_product(x, activation, layer.down)

    # a subclass whose products are partial sums to be reduced across ranks (tensor parallelism)
    _partial_products = False

    def _add_product(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight.T`` for a layer's output projections: added into ``residual`` in place,
        inside the product, where :func:`~dspark_core.models.layers.residual_linear` fuses it, unless the
        product is batch-invariant or a partial sum that must be reduced before it is added."""
        if self.batch_invariant or self._partial_products:
            return residual + self._reduce(self._product(x, weight))
        return residual_linear(residual, x, weight)

    def logits_from_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head, float32 logits."""
        return self._product(rms_norm(x, self.final_norm, self.config.rms_eps), self.lm_head).float()

    def greedy_from_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm + each row's greedy token: through :class:`~dspark_core.models.greedy_head.GreedyHead`
        where it applies (a float32 head on a CPU with native bfloat16 products), else ``argmax`` of
        :meth:`logits_from_hidden`'s logits."""
        head = self._greedy_head()
        if head is None:
            return greedy_tokens(self.logits_from_hidden(x))
        return head(rms_norm(x, self.final_norm, self.config.rms_eps))

    @property
    def greedy_head_active(self) -> bool:
        """Whether :meth:`greedy_from_hidden` goes through the bfloat16 :class:`GreedyHead` here."""
        return self._greedy_head() is not None

    def _greedy_head(self) -> GreedyHead | None:
        if self.lm_head.dtype != torch.float32 or self.lm_head.device.type != "cpu" or static_shapes_active() \
                or not greedy_head.enabled():
            return None
        cached = getattr(self, "_greedy_head_cache", None)  # (the weight it was built from, the head)
        if cached is None or cached[0] is not self.lm_head:  # built on first use (60 MB for SmolLM2)
            cached = (self.lm_head, GreedyHead(self.lm_head.detach()))
            self._greedy_head_cache = cached
        return cached[1]

    def _static_layout(self, batch: ForwardBatch, cache: KVCache) -> tuple[RowLayout, OneRowCells | None]:
        """The attention layout of a static-shape forward, sized by the key (the batch size, the cache and
        ``max_request_rows``), not read from the batch; and the one-row cells where it computes in them."""
        kv_len = static_kv_length(cache.max_len)
        if self.batch_invariant:  # whole key blocks, as the eager forward reads them
            kv_len = invariant_kv_length(kv_len, cache.max_len)
        # a request's attention is sized for the rows it may have: the batch's bound where it has one
        # (a verify step: its anchor and the drafted rows the tier has room for), else every row of the batch
        max_rows = batch.num_rows if batch.max_request_rows is None else min(batch.num_rows, batch.max_request_rows)
        window = static_window_pays(cache.num_slots, int(batch.slot_ids.shape[0]))  # read the cache in place
        if max_rows == 1 and batch.padding_slot is not None:  # one row per request: no gathers per layer
            cells = OneRowCells.build(batch.positions, batch.slot_ids, batch.row_offsets, kv_len=kv_len,
                                      padding_slot=batch.padding_slot,
                                      window_slots=window_cells(cache.num_slots, batch.padding_slot) if window else None,
                                      padding_last=batch.padding_last)
            return cells.layout, cells
        if window:
            return RowLayout.static_window(batch.positions, batch.slot_ids, batch.row_offsets, num_slots=cache.num_slots,
                                           max_rows=max_rows, kv_len=kv_len, padding_slot=batch.padding_slot), None
        return RowLayout.build(batch.positions, batch.slot_ids, batch.row_offsets, max_rows=max_rows, kv_len=kv_len,
                               padding_last=batch.padding_last), None

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: KVCache, hidden_layers: tuple[int, ...] = (),
                logit_rows: torch.Tensor | None = None, greedy_only: bool = False) -> ForwardOutput:
        """Write every row's K/V at (slot, position), then attend each row to its slot's keys <= its
        position; logits of ``logit_rows`` only when given (see :class:`~dspark_core.models.base.TargetModel`)."""
        self.check_hidden_layers(hidden_layers)
        cells = None  # where a static forward computes the rows in one-row cells (row_cells)
        if static_shapes_active():  # graph capture: shapes from the batch size and cache, no host reads
            layout, cells = self._static_layout(batch, cache)
        else:
            layout = RowLayout.build(batch.positions, batch.slot_ids, batch.row_offsets, slot_window=True,
                                     padding_slot=batch.padding_slot, max_request_rows=batch.max_request_rows)
            cache.check_fits(layout.kv_len - 1)
            if self.batch_invariant:  # whole key blocks (see invariant_attention); the extra keys are masked
                layout = evolve(layout, kv_len=invariant_kv_length(layout.kv_len, cache.max_len))
        heads = self.head_config
        groups = heads.num_heads // heads.num_kv_heads
        if self.batch_invariant and not static_shapes_active():  # eager CPU: attention in row bands
            extents = (layout.query_positions.amax(1) + 1).tolist()
            bands = plan_bands(layout.causal_mask(), layout.valid.sum(1).tolist(), groups, self.dtype, extents)
            mask, folding = None, None
        else:
            bands, mask = None, grouped_mask(layout.causal_mask(), groups, self.dtype)
            folding = layout.head_folding(heads.num_heads, heads.num_kv_heads) if cells is None else None
        tokens, positions = (batch.tokens, batch.positions) if cells is None else (batch.tokens[cells.row_of_cell],
                                                                                    cells.positions)
        cos, sin = self.rope_tables(positions)
        x = self.embed[tokens]
        # the asked-for hidden states are copied into their columns of the output as the residual stream
        # passes them (copies, since the residual products may add into x in place; and no join after)
        hidden = x.new_empty((x.shape[0], len(hidden_layers) * x.shape[1])) if hidden_layers else None
        columns = () if hidden is None else hidden.split(x.shape[1], dim=1)
        _copy_hidden(columns, hidden_layers, 0, x)
        for i, layer in enumerate(self.layers):
            q, kv_rows = self._qkv(layer, x, cos, sin)
            # Write first, then read: the rows see their own and earlier rows' keys.
            cache.write_rows(i, layout.slot_of_row, positions, kv_rows)
            keys, values = layout.read(cache, i, batch.slot_ids)
            if cells is None:
                attended = attend(q, keys, values, layout, mask, self.batch_invariant, bands, folding)
            else:
                attended = attend_cells(q, keys, values, mask, self.batch_invariant)
            x = self._add_product(x, attended, layer.o_proj)
            x = self._mlp(layer, x)
            _copy_hidden(columns, hidden_layers, i + 1, x)
        if cells is not None:  # the packed rows' results, from their cells
            x = x[cells.cell_of_row]
            hidden = None if hidden is None else hidden[cells.cell_of_row]
        rows = x if logit_rows is None else x[logit_rows]
        if greedy_only:
            return ForwardOutput(None, hidden, self.greedy_from_hidden(rows))
        return ForwardOutput(self.logits_from_hidden(rows), hidden)


def _copy_hidden(columns: tuple[torch.Tensor, ...], hidden_layers: tuple[int, ...], depth: int, x: torch.Tensor) -> None:
    """Copy the residual stream ``x`` after ``depth`` decoder layers into each output column that asks for it."""
    for column, wanted in zip(columns, hidden_layers):
        if wanted == depth:
            column.copy_(x)

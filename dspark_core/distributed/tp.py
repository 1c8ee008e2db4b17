"""Tensor parallelism for the Llama target: heads and MLP columns split across ranks.

Each rank keeps a contiguous run of key/value heads together with the query
heads that read them, and a contiguous run of MLP intermediate columns:

* the fused q/k/v and gate/up matrices are *column parallel*: a rank only
  computes its own heads / columns, so no communication is needed before
  attention or the activation;
* o_proj and down are *row parallel*: a rank multiplies its slice of the
  input features and the partial results are summed with one all-reduce.

Splits may be uneven (SmolLM2 has 3 KV heads; over 2 ranks one rank keeps
2 and the other 1), so any ``tp <= num_kv_heads`` works. Embeddings, norms
and the LM head stay replicated: every rank ends a forward with the full
residual stream and full logits, which is what the (replicated) DSpark draft
and the greedy verification read. The KV cache of a rank holds only its own
heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from attrs import evolve

from dspark_core.errors import ConfigError
from dspark_core.models.base import TargetConfig
from dspark_core.models.llama import LlamaLayer, LlamaTarget


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part ``index`` when ``total`` items are cut into ``parts`` contiguous runs
    (the first ``total % parts`` runs are one longer)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _cat_slices(weight: torch.Tensor, spans: list[tuple[int, int]], dim: int = 0) -> torch.Tensor:
    return torch.cat([weight.narrow(dim, a, b - a) for a, b in spans], dim=dim).contiguous()


def _shard_layer(layer: LlamaLayer, cfg, kv: tuple[int, int], inter: tuple[int, int]) -> None:
    hd, group = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    q_total, kv_total = cfg.num_heads * hd, cfg.num_kv_heads * hd
    q_span = (kv[0] * group * hd, kv[1] * group * hd)
    k_span = (q_total + kv[0] * hd, q_total + kv[1] * hd)
    v_span = (q_total + kv_total + kv[0] * hd, q_total + kv_total + kv[1] * hd)
    param = lambda t: torch.nn.Parameter(t, requires_grad=False)  # noqa: E731
    layer.qkv = param(_cat_slices(layer.qkv.data, [q_span, k_span, v_span]))
    if layer.qkv_bias is not None:
        layer.qkv_bias = param(_cat_slices(layer.qkv_bias.data, [q_span, k_span, v_span]))
    layer.o_proj = param(_cat_slices(layer.o_proj.data, [q_span], dim=1))
    i_total = cfg.intermediate_size
    layer.gate_up = param(_cat_slices(layer.gate_up.data, [inter, (i_total + inter[0], i_total + inter[1])]))
    layer.down = param(_cat_slices(layer.down.data, [inter], dim=1))


class TensorParallelLlama(LlamaTarget):
    """A :class:`LlamaTarget` whose layers hold one rank's shard.

    ``config`` stays the full model's (the engine, the draft and the tokenizer
    see the same model as on one rank); ``local`` describes this rank's share.
    """

    _partial_products = True  # each rank's output projections are summed across ranks, then added

    def __init__(self) -> None:  # built by :func:`shard_llama`, never directly
        raise TypeError("use shard_llama(target, rank, world_size, group)")

    @property
    def head_config(self) -> TargetConfig:
        return self.local

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(partial, group=self.tp_group)
        return partial


def shard_llama(target: LlamaTarget, rank: int, world_size: int, group=None) -> LlamaTarget:
    """Cut ``target`` in place down to rank ``rank``'s shard; returns it as a :class:`TensorParallelLlama`.

    ``world_size == 1`` returns the target unchanged. Needs ``world_size <=
    num_kv_heads`` and ``<= intermediate_size``.
    """
    if world_size == 1:
        return target
    if type(target) is not LlamaTarget:
        raise ConfigError(
            f"tensor parallelism over {world_size} ranks supports the Llama target family only, "
            f"not {type(target).__name__}; run it with --nnodes=1"
        )
    cfg = target.config
    if world_size > cfg.num_kv_heads:
        raise ConfigError(
            f"nnodes={world_size}: the target has {cfg.num_kv_heads} key/value heads, so at most {cfg.num_kv_heads} "
            "tensor-parallel ranks can share it"
        )
    kv = split_range(cfg.num_kv_heads, world_size, rank)
    inter = split_range(cfg.intermediate_size, world_size, rank)
    group_size = cfg.num_heads // cfg.num_kv_heads
    for layer in target.layers:
        _shard_layer(layer, cfg, kv, inter)
    target.__class__ = TensorParallelLlama
    target.local = evolve(cfg, num_kv_heads=kv[1] - kv[0], num_heads=(kv[1] - kv[0]) * group_size,
                          intermediate_size=inter[1] - inter[0])
    target.tp_group = group
    target.tp_rank, target.tp_size = rank, world_size
    return target

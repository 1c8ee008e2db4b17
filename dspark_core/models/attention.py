"""Attention over the KV cache for packed rows: the masks, the kernels (matmul, SDPA, batch-invariant,
a draft block's) and :func:`attend`, which folds the query heads that share a key head into its rows."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dspark_core.models.row_layout import HeadFolding, RowLayout


def grouped_mask(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """The boolean causal mask ``[B, 1, R, L]`` as the additive mask :func:`attend` takes:
    ``[B, 1, groups * R, L]``, 0 where a query sees a key and -inf elsewhere, repeated for the
    ``groups`` query heads that share one key head. Build it once per forward, not per layer."""
    b, _, r, length = mask.shape
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return additive[:, :, None].expand(b, 1, groups, r, length).reshape(b, 1, groups * r, length)


# Query rows per key head up to which CUDA attention runs as two matmuls around a softmax. SDPA's
# float32 kernel (memory-efficient attention) gives each block of 64 query rows of a key head one
# thread block that walks every key: a decode or verify step (3-24 rows per key head for SmolLM2)
# then keeps 3-192 blocks busy on 132 SMs, and on the H200 one layer of one request over the
# 2 048 captured key positions took 216 us, 73 % of a target-only step. The matmuls spread the key
# axis over the whole GPU. Prefill (more rows) keeps SDPA, whose memory use does not grow with the
# rows x keys scores.
MATMUL_ATTENTION_MAX_ROWS = 64
ATTENTION_KERNELS = ("auto", "sdpa", "matmul")
_attention_kernel = "auto"


def set_attention_kernel(name: str) -> None:
    """Choose how :func:`attend` computes attention, process-wide: ``auto`` (the default: matmuls
    for decode-sized row counts on CUDA, SDPA otherwise), ``sdpa`` or ``matmul`` everywhere. For
    benchmarks that compare the two on one device."""
    global _attention_kernel
    if name not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {name!r}: choose one of {', '.join(ATTENTION_KERNELS)}")
    _attention_kernel = name


def _matmul_attention_for(q: torch.Tensor) -> bool:
    if _attention_kernel == "auto":
        return q.is_cuda and q.shape[2] <= MATMUL_ATTENTION_MAX_ROWS
    return _attention_kernel == "matmul"


def matmul_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + mask) v`` as two batched matmuls; the softmax in float32 at least.

    ``q`` ``[B, KV, rows, d]``, ``keys``/``values`` ``[B, KV, L, d]``, ``mask`` additive and
    broadcastable to ``[B, KV, rows, L]``. Every query row sees at least one key (its own position).
    """
    weights = _attention_weights(torch.matmul(q, keys.transpose(-1, -2)), mask, q.shape[-1], values.dtype)
    return torch.matmul(weights, values)


def _attention_weights(scores: torch.Tensor, mask: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``softmax(mask + scores / sqrt(head_dim))`` over the last axis, in float32 at least, returned in
    ``dtype`` (the values'): the one softmax of every matmul form of attention."""
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    # mask + scale * scores as one kernel, not a product then a sum over the whole scores tensor (every
    # layer pays for it). The same bits as the two where the scale is a power of two (head_dim 64: 1/8)
    return torch.softmax(torch.add(mask, scores, alpha=head_dim**-0.5), dim=-1).to(dtype)


# The CPU flash-attention kernel (aten::_scaled_dot_product_flash_attention_for_cpu) reduces keys
# in blocks of this many at every query length. Batch-invariant forwards read whole blocks (see
# invariant_kv_length), so a row's blocks, and their bits, do not depend on how many keys the rest
# of the batch needs.
KEY_BLOCK = 512
# A last block shorter than KEY_BLOCK that still gives every row of it the bits a whole block
# gives, where invariant_key_tails() measures so. Which ones do depends on how the kernel's value
# product groups its sums over a block's keys, so on the BLAS build and the CPU: on an AVX2 EPYC
# tails of 128 and 384 keys passed and 256 and 320 did not; on an AMX Xeon every tail up to 256
# passed and none from 288 on. Each candidate is checked on its own, so short contexts read the
# shortest tail this CPU allows that covers them instead of a whole block.
CANDIDATE_KEY_TAILS = tuple(range(64, KEY_BLOCK, 64))
# Fewer folded query rows than this take another product path inside that kernel, whose bits
# differ (measured on torch 2.13: 3 rows differ from 4+; 4 to 3 000 rows agree), so calls are
# padded up to it.
MIN_FOLDED_ROWS = 4


def invariant_kv_length(needed: int, cache_length: int, tails: tuple[int, ...] | None = None) -> int:
    """Keys a batch-invariant forward reads when its rows need ``needed``: whole
    :data:`KEY_BLOCK` blocks, the last one possibly one of the shorter ``tails`` (default:
    :func:`invariant_key_tails`). A block the cache cannot hold whole is read up to the cache's
    end, so every row in it always meets the same short block."""
    full, tail = divmod(needed, KEY_BLOCK)
    if tail == 0:
        return min(needed, cache_length)
    if (full + 1) * KEY_BLOCK > cache_length:
        return cache_length
    tails = invariant_key_tails() if tails is None else tails
    return full * KEY_BLOCK + next((t for t in tails if t >= tail), KEY_BLOCK)


def invariant_cache_length(max_len: int) -> int:
    """Positions a batch-invariant KV cache allocates to hold ``max_len``: ``max_len`` rounded up to
    a length :func:`invariant_kv_length` reads, a whole number of key blocks or a checked tail.

    A read that reaches the cache's end stops there, so the cache's last block must itself be one
    whose bits the invariance check covers: on the development CPU a last block of 2 or 3 keys gave
    a row other bits depending on where it sat in the call (a hypothesis case of two rows over a
    two-key cache found it). The extra positions are never written and always masked; SmolLM2's
    default lengths (multiples of 512) allocate nothing more."""
    return invariant_kv_length(max_len, max_len + KEY_BLOCK)


@functools.cache
def invariant_key_tails() -> tuple[int, ...]:
    """The last-block lengths :func:`invariant_kv_length` may use on this CPU: those of
    :data:`CANDIDATE_KEY_TAILS` that :func:`key_tail_invariant` accepts, checked once per process
    (every block whole where none is)."""
    return tuple(tail for tail in CANDIDATE_KEY_TAILS if key_tail_invariant(tail))


def key_tail_invariant(tail: int) -> bool:
    """Whether reading a last block of ``tail`` keys gives every row it covers (within the first
    ``tail`` keys of its block, in the first and the second block) the bits that reading the whole
    block gives (two requests of two rows each, random keys, positions 5 apart). Every accepted tail
    then agrees with every other on the rows they both cover, since each agrees with the whole block."""
    generator = torch.Generator().manual_seed(0)
    kv_heads, groups, head_dim, length = 2, 3, 64, 2 * KEY_BLOCK
    keys, values = (torch.randn(2, kv_heads, length, head_dim, generator=generator) for _ in range(2))
    for start in (0, KEY_BLOCK):
        for position in range(start + 1, start + tail, 5):
            q = torch.randn(2, kv_heads, 2 * groups, head_dim, generator=generator)
            positions = torch.tensor([position - 1, position] * groups)
            outputs = []
            for read in (start + tail, start + KEY_BLOCK):
                mask = torch.zeros(1, 1, positions.shape[0], read).masked_fill_(
                    torch.arange(read)[None, None, None, :] > positions[None, None, :, None], float("-inf"))
                outputs.append(invariant_attention(q, keys[:, :, :read], values[:, :, :read], mask))
            if not torch.equal(*outputs):
                return False
    return True


def invariant_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention whose every query row gets the same bits whatever else is in the batch.

    ``q`` ``[B, KV, rows, d]``, ``keys``/``values`` ``[B, KV, L, d]``, ``mask`` additive,
    ``[B or 1, 1, rows, L]``; computed in float32 at least and returned in ``q``'s dtype.

    One call of torch's CPU flash-attention kernel. Per query row it reduces the head dimension in
    a product and the keys block by block (:data:`KEY_BLOCK`), each block's exponentials summed
    in a fixed vector order and the blocks folded in key order. Keys a row cannot see add exact
    zeros (their weight is ``exp(-inf)``, and the cache holds finite values), so reading more
    blocks past a row's position leaves its bits alone, provided every call reads whole blocks
    (:func:`invariant_kv_length`). Two conditions keep the products themselves invariant, both
    measured rather than documented: at least :data:`MIN_FOLDED_ROWS` query rows, and at least
    two ``(request, key head)`` pairs, because a call with one pair runs outside the kernel's
    parallel region and the product it calls may then split its work across threads.
    ``tests/test_batch_invariance.py`` checks rows, requests, key lengths and thread counts.
    It replaced a kernel of one product per 128-key chunk (benchmarks/attention_kernel.py, AVX2
    EPYC): 0.65-0.97x its time at 16 requests of 250-400 keys, 0.77-0.83x on uneven steps and
    0.35-0.72x for one request, but 1.14-1.26x when every request is below 256 keys (384 keys
    read where 256 were).
    """
    batch, kv_heads, rows, _ = q.shape
    compute = torch.promote_types(q.dtype, torch.float32)
    padded_q, padded_mask = q.to(compute), mask.to(compute)
    if rows < MIN_FOLDED_ROWS:  # the extra rows see every key (a finite, unread result)
        padded_q = F.pad(padded_q, (0, 0, 0, MIN_FOLDED_ROWS - rows))
        padded_mask = F.pad(padded_mask, (0, 0, 0, MIN_FOLDED_ROWS - rows))
    keys, values = keys.to(compute), values.to(compute)
    if batch * kv_heads == 1:  # a second copy of the request keeps the call in the parallel region
        padded_q, keys, values = (torch.cat([t, t]) for t in (padded_q, keys, values))  # (the mask broadcasts)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(padded_q, keys, values, attn_mask=padded_mask)[0]
    return out[:batch, :, :rows].to(q.dtype)


def context_block_attention(q: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor],
                            block: tuple[torch.Tensor, torch.Tensor], sees_context: torch.Tensor) -> torch.Tensor:
    """A draft block's attention: queries ``q`` ``[B, H, S, d]`` over their context's keys and values
    (``context``, ``[B, KV, L, d]`` each, a view of the cache or a gather) and over the block's own
    (``block``, ``[B, KV, S, d]`` each), which every row of the block sees (the block is
    non-causal); ``sees_context`` (bool ``[B, L]``) marks the context positions a block attends.
    Query head ``h`` reads key head ``h // (H / KV)``.

    The two parts are scored apart and share one softmax (float32 at least), so the context is not
    copied once more, per layer and proposal, to put the block's keys behind it. The query heads of
    a key head are folded into its rows, two matmuls per part, as in :func:`matmul_attention`. On
    the development CPU (float32, 16 requests over 1 500 context positions, gathered) a proposal
    took 29 ms this way and 35 ms with the copy and SDPA. The scores are held whole (float32
    ``[B, KV, folded rows, L + S]``), so a draft with more than :data:`MATMUL_ATTENTION_MAX_ROWS`
    folded rows per key head takes SDPA on the joined keys instead, whose memory does not grow
    with them.
    """
    batch, heads, rows, head_dim = q.shape
    (context_keys, context_values), (block_keys, block_values) = context, block
    kv_heads, length = context_keys.shape[1], context_keys.shape[2]
    folded = q.reshape(batch, kv_heads, heads // kv_heads * rows, head_dim)
    if folded.shape[2] > MATMUL_ATTENTION_MAX_ROWS:
        keys, values = torch.cat([context_keys, block_keys], dim=2), torch.cat([context_values, block_values], dim=2)
        sees = torch.cat([sees_context, sees_context.new_ones(batch, rows)], dim=1)[:, None, None, :]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=sees, enable_gqa=heads != kv_heads)
    scores = torch.cat([torch.matmul(folded, context_keys.transpose(-1, -2)),
                        torch.matmul(folded, block_keys.transpose(-1, -2))], dim=-1)
    mask = torch.zeros((batch, 1, 1, length + rows), dtype=torch.float32, device=scores.device)
    mask[:, 0, 0, :length].masked_fill_(~sees_context, float("-inf"))
    weights = _attention_weights(scores, mask, head_dim, context_values.dtype)
    out = torch.matmul(weights[..., :length], context_values)
    out = out + torch.matmul(weights[..., length:], block_values)
    return out.reshape(batch, heads, rows, head_dim)


def attend(q_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: RowLayout, mask: torch.Tensor | None,
           invariant: bool = False, bands: list | None = None, folding: HeadFolding | None = None) -> torch.Tensor:
    """Attention of packed queries ``[G, H, hd]`` over per-request keys ``[B, KV, L, hd]``.

    Returns ``[G, H * hd]``. ``mask`` comes from :func:`grouped_mask`. Query head ``h`` reads
    key head ``h // (H / KV)`` (grouped-query attention). The ``H / KV`` query heads of a key
    head are folded into its query rows, so attention runs as ``KV`` heads of ``(H / KV) * R``
    rows each: the same sums as SDPA's ``enable_gqa``, without copying keys per query head,
    and in a few large blocks instead of many blocks of ``R`` rows (a verify step has 1-8
    rows per request). On the development CPU it cut SmolLM2's attention by a quarter at
    4 requests of 2 rows and 300 tokens of context (0.55 -> 0.41 ms per layer).
    ``invariant``: through :func:`invariant_attention` (the batch reading whole key blocks, see
    :func:`invariant_kv_length`), so a row's output does not depend on the other rows or on how
    many keys past its own position the batch reads. ``bands`` (invariant only, instead of
    ``mask``): :mod:`~dspark_core.models.row_bands`, so a request pays for its own rows only.
    ``folding``: :meth:`RowLayout.head_folding` of the layout, built once per forward by callers
    that attend every layer (built here when not given).
    """
    if invariant and bands is not None:
        from dspark_core.models.row_bands import banded_attention

        return layout.unpad(banded_attention(layout.pad(q_rows), keys, values, bands)).reshape(q_rows.shape[0], -1)
    assert mask is not None, "attend needs the additive mask unless row bands are given"
    if folding is None:
        folding = layout.head_folding(q_rows.shape[1], keys.shape[1])
    head_dim = q_rows.shape[-1]
    folded = q_rows[folding.gather_rows, folding.gather_heads]  # [B, KV, groups * R, hd]
    out = attention_of_folded(folded, keys, values, mask, invariant)
    return out.reshape(-1, head_dim)[folding.scatter].reshape(q_rows.shape[0], -1)


def attention_of_folded(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                        invariant: bool = False) -> torch.Tensor:
    """Attention of folded queries ``[B, KV, rows, d]`` (see :func:`attend`): :func:`invariant_attention`,
    or the default kernel on keys and values in the queries' dtype."""
    if invariant:
        return invariant_attention(q, keys, values, mask)
    return _default_attention(q, keys.to(q.dtype), values.to(q.dtype), mask)


def _default_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The non-invariant kernel for folded queries: two matmuls where they pay (:func:`_matmul_attention_for`), else SDPA."""
    if _matmul_attention_for(q):
        return matmul_attention(q, keys, values, mask)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def folded_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     kernel: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Padded queries ``[B, R, H, d]``: the ``H / KV`` query heads of each key head folded into its
    rows, ``kernel(folded, keys, values, mask)`` run on ``KV`` heads, and the result unfolded to
    ``[B, R, H, d]`` (the layout :func:`attend` and the row bands share)."""
    requests, rows, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    folded = q.permute(0, 2, 1, 3).reshape(requests, kv_heads, heads // kv_heads * rows, head_dim)
    return kernel(folded, keys, values, mask).reshape(requests, heads, rows, head_dim).transpose(1, 2)


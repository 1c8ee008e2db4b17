"""Building blocks shared by the target and the DSpark draft: norms, rotary, packed attention."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from attrs import frozen

from dspark_core.errors import ModelError
from dspark_core.models.cpu_linear import packed_linear, takes_packed_path


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 (as the reference implementations do), cast back."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # the same sums through torch's own op (bit-identical on the CPU): one call instead of six
        # elementwise and reduction ops, and one fused kernel where the device has one
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of every row of ``logits`` ``[..., vocab]``: the first index of the row's
    maximum, as ``argmax`` gives it. ``max(dim).indices`` picks the same index (ties go to the
    first) and on the CPU reads a row of SmolLM2's 49 152 logits about three times faster than
    ``argmax`` does (25 against 75 µs a row, one thread), which is 1-2 % of a verify step."""
    return logits.max(dim=-1).indices


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables ``[N, head_dim]`` for :func:`apply_rope` (rotate-half convention): the cosines, and the
    sines with the first half negated (the sign rotate-half gives the second half of each vector when
    it moves to the front), so a layer rotates without negating its own rows. Built once per forward."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    half = head_dim // 2
    sign = torch.cat([angles.new_full((half,), -1.0), angles.new_ones(half)])
    return angles.cos().to(dtype), (angles.sin() * sign).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ([N, heads, head_dim]) by per-row angles (rotate-half layout), with the tables of
    :func:`rope_cos_sin` (``[N, head_dim]``, every head alike) or of :func:`rope_tables_per_head`
    (``[N, heads, head_dim]``): ``x * cos + roll(x, half) * signed_sin``. Bit-identical to the textbook
    ``x * cos + cat(-x2, x1) * sin`` (a product's sign is exact), in one device kernel fewer per call:
    the roll replaces the negation and the concatenation (every layer of every step pays for it)."""
    if cos.dim() == 2:
        cos, signed_sin = cos[:, None, :], signed_sin[:, None, :]
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def rope_tables_per_head(cos: torch.Tensor, signed_sin: torch.Tensor, rotated_heads: int,
                         kept_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables ``[N, rotated_heads + kept_heads, head_dim]`` that rotate the first ``rotated_heads`` heads
    as :func:`rope_cos_sin`'s do and give the last ``kept_heads`` back unchanged (cosine 1, sine 0:
    ``x * 1 + roll(x) * 0`` is ``x`` for every finite ``x``). One rotary pass over a fused projection's
    query, key and value heads then leaves the keys and values side by side in one tensor, which the
    KV cache stores with one indexed write (:meth:`~dspark_core.models.kv_cache.KVCache.write_rows`).
    Build them once per forward."""
    rows, head_dim = cos.shape
    shape = (rows, rotated_heads, head_dim)
    return (torch.cat([cos[:, None, :].expand(shape), cos.new_ones(rows, kept_heads, head_dim)], dim=1),
            torch.cat([signed_sin[:, None, :].expand(shape), signed_sin.new_zeros(rows, kept_heads, head_dim)], dim=1))


# Fewer rows than this take a slower kernel on the CPU, so 1-3 rows are padded up to it. Packed
# oneDNN path (cpu_linear): SmolLM2's 1- and 2-row products cost 15-50% more than 4-row ones (fused
# gate/up, 1 thread: 0.57/0.65 ms against 0.47 ms; LM head 7.7/9.5 ms against 6.2 ms). F.linear
# (MKL) fallback: 2-3 rows run as one matrix-vector product per row, each streaming the whole weight.
# Narrow inputs (the draft's rank-64 Markov head) are not padded: the copy costs more than it saves.
_CPU_MIN_ROWS = 4
_CPU_PAD_MIN_FEATURES = 256


def _padded_product(product, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    padded = torch.cat([x, x.new_zeros(_CPU_MIN_ROWS - rows, x.shape[1])])
    return product(padded, weight, bias)[:rows]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for inference; on the CPU through a packed oneDNN weight (:mod:`cpu_linear`), with
    packed rows ``[G, in]`` of fewer than 4 rows padded to 4 (2-3 rows without oneDNN; see above)."""
    short = x.device.type == "cpu" and x.dim() == 2 and x.shape[0] < _CPU_MIN_ROWS
    if takes_packed_path(x, weight, bias):
        if short and x.shape[1] >= _CPU_PAD_MIN_FEATURES:
            return _padded_product(packed_linear, x, weight, bias)
        return packed_linear(x, weight, bias)
    if short and x.shape[0] > 1:
        return _padded_product(F.linear, x, weight, bias)
    return F.linear(x, weight, bias)


# A bfloat16 CPU product of at most this many rows gives each row the same bits whatever the row
# count; from 33 rows on oneDNN (AMX and AVX512-BF16, torch 2.13) switches kernels and a row's sums
# change order. Float32 products kept every row's bits at every row count measured (1-512).
INVARIANT_PRODUCT_ROWS = 32


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear` whose every row comes out bit-identical whatever the other rows are: float32
    as is, other dtypes in products of at most :data:`INVARIANT_PRODUCT_ROWS` rows."""
    if x.dtype == torch.float32 or x.shape[0] <= INVARIANT_PRODUCT_ROWS:
        return linear(x, weight, bias)
    return torch.cat([linear(part, weight, bias) for part in x.split(INVARIANT_PRODUCT_ROWS)])


# Row counts the self-check compares with one large product: 1-4 (padded), around the piece limit,
# and several pieces with a short last one.
_CHECKED_ROW_COUNTS = (1, 2, 3, 5, 8, 17, 31, 32, 33, 47, 64, 96)


def products_rows_invariant(dtype: torch.dtype) -> bool:
    """Whether :func:`invariant_linear` in ``dtype`` gives every row the same bits at every row
    count on this CPU: measured once per process on random products of SmolLM2-like shapes, not
    assumed. The piece limit was measured on two CPUs with one oneDNN build; another build or CPU
    may block its kernels differently, and then a bfloat16 target must not count on exactness."""
    return _products_rows_invariant(dtype, INVARIANT_PRODUCT_ROWS)


@functools.cache
def _products_rows_invariant(dtype: torch.dtype, piece_rows: int) -> bool:
    generator = torch.Generator().manual_seed(0)
    rows = max(_CHECKED_ROW_COUNTS) + 8
    for in_features, out_features in ((576, 1536), (1536, 576), (576, 4096)):
        # float32 data rounded once: bfloat16 inputs hide summation-order differences less than
        # random bfloat16-exact data would
        weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        whole = invariant_linear(x, weight)
        for count in _CHECKED_ROW_COUNTS:
            for start in (0, 7):
                if not torch.equal(invariant_linear(x[start : start + count], weight), whole[start : start + count]):
                    return False
    return True


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, product=linear) -> torch.Tensor:
    """SwiGLU MLP with the gate and up projections fused into one matrix (``product``: the matrix
    product to use, :func:`linear` or :func:`invariant_linear`)."""
    gate, up = product(x, gate_up).chunk(2, dim=-1)
    return product(F.silu(gate) * up, down)


# A window of slots is read in place when it spans at most this many slots per live request:
# attending a few idle slots' keys costs less than copying every live slot's prefix each layer
# (SmolLM2 attention, 16 requests x 400 keys, one layer, 1 thread: 0.8 ms in place, 6.9 ms gathered).
_MAX_WINDOW_SLOTS_PER_REQUEST = 2


def static_window_pays(num_slots: int, requests: int) -> bool:
    """Whether a static-shape forward of ``requests`` requests (the padding one included) over a cache
    of ``num_slots`` slots reads the whole cache in place (:meth:`RowLayout.static_window`) rather
    than gathering each request's keys: by the eager rule, when that is at most
    ``_MAX_WINDOW_SLOTS_PER_REQUEST`` slots per request. An engine's largest bucket then reads in place
    (its cache has one slot per bucket entry and the scratch slot); one request of sixteen gathers."""
    return num_slots <= _MAX_WINDOW_SLOTS_PER_REQUEST * requests


def _slot_window(counts: list[int], slots: list[int], padding_slot: int | None) -> tuple[int, int, list[int]] | None:
    """``(first slot, width, live requests)`` of the slot window of a batch (host lists), or None
    when the live requests' slots repeat or are spread too thinly for reading in place to pay."""
    live = [i for i, (count, slot) in enumerate(zip(counts, slots)) if count > 0 and slot != padding_slot]
    live_slots = [slots[i] for i in live]
    if not live or len(set(live_slots)) != len(live_slots):
        return None
    first, width = min(live_slots), max(live_slots) - min(live_slots) + 1
    return (first, width, live) if width <= _MAX_WINDOW_SLOTS_PER_REQUEST * len(live) else None


@frozen
class RowLayout:
    """How packed rows map to a padded ``[B, R_max]`` view, computed once per forward.

    Linear layers run on the packed rows; only attention uses the padded view,
    gathered through ``pad_index`` (padding entries point at row 0) and
    scattered back through ``unpad_index`` (an integer gather, so going back
    needs no host read and has the fixed shape ``[G]``).

    Padded row ``b`` is request ``b``, whose keys are gathered from its cache
    slot; or, in a *slot window* (``first_slot`` set), cache slot
    ``first_slot + b``, so attention reads a contiguous run of slots in place
    and idle slots in the run get dummy queries. Rows of padding requests then
    come back as a copy of a live row (their outputs are never read).
    """

    pad_index: torch.Tensor  # int64 [B, R_max]
    valid: torch.Tensor  # bool [B, R_max]
    slot_of_row: torch.Tensor  # int64 [G]
    query_positions: torch.Tensor  # int64 [B, R_max]; 0 on padding
    kv_len: int  # keys needed: max position + 1
    unpad_index: torch.Tensor  # int64 [G]: each packed row's cell in the flattened [B * R_max] view
    first_slot: int | None = None  # slot window start; None: padded rows are requests

    @classmethod
    def build(cls, positions: torch.Tensor, slot_ids: torch.Tensor, row_offsets: torch.Tensor, *,
              max_rows: int | None = None, kv_len: int | None = None, slot_window: bool = False,
              padding_slot: int | None = None, max_request_rows: int | None = None) -> RowLayout:
        """Layout of a batch. With ``max_rows`` and ``kv_len`` given (static-shape mode) nothing is
        read back to the host and every shape is fixed by the arguments; a request with more rows
        than ``max_rows`` (only the padding one may have them) attends its first ``max_rows`` and
        its later rows read back the last of those. Otherwise one host read sizes it (and checks
        ``max_request_rows``, the bound a static forward of the same batch would be given), and with
        ``slot_window`` the keys are read in place when the live requests' slots (those not on
        ``padding_slot``) are close enough together."""
        counts = row_offsets[1:] - row_offsets[:-1]
        requests = counts.shape[0]
        window = None
        if max_rows is None or kv_len is None:
            host = torch.cat([counts, slot_ids, positions.max()[None]]).tolist()  # the one host read
            if max_request_rows is not None:
                _check_request_rows(host[:requests], host[requests : 2 * requests], padding_slot, max_request_rows)
            max_rows = max(host[:requests]) if max_rows is None else max_rows
            kv_len = host[-1] + 1 if kv_len is None else kv_len
            if slot_window:
                window = _slot_window(host[:requests], host[requests : 2 * requests], padding_slot)
                first_cell = host[requests + window[2][0]] - window[0] if window is not None else 0
        device = positions.device
        steps = torch.arange(max_rows, device=device)
        valid = steps[None, :] < counts[:, None]
        pad_index = torch.where(valid, row_offsets[:-1, None] + steps[None, :], torch.zeros_like(valid, dtype=torch.long))
        query_positions = torch.where(valid, positions[pad_index], torch.zeros_like(pad_index))
        slot_of_row, request_of_row, step_of_row = _row_coordinates(positions, slot_ids, row_offsets, counts, max_rows)
        if window is None:
            return cls(pad_index, valid, slot_of_row, query_positions, kv_len, request_of_row * max_rows + step_of_row)
        first_slot, width, live = window
        live_index = torch.tensor(live, device=device)
        cell_of_live = slot_ids[live_index] - first_slot
        # padding requests read back the first cell of the first live request
        cell_of_request = torch.full((requests,), first_cell, dtype=torch.long, device=device)
        cell_of_request[live_index] = cell_of_live
        is_live = torch.zeros(requests, dtype=torch.bool, device=device)
        is_live[live_index] = True

        def to_window(per_request: torch.Tensor) -> torch.Tensor:
            out = per_request.new_zeros((width, max_rows))
            out[cell_of_live] = per_request[live_index]
            return out

        unpad_index = cell_of_request[request_of_row] * max_rows + torch.where(is_live[request_of_row], step_of_row, 0)
        return cls(to_window(pad_index), to_window(valid), slot_of_row, to_window(query_positions), kv_len,
                   unpad_index, first_slot)

    @classmethod
    def static_window(cls, positions: torch.Tensor, slot_ids: torch.Tensor, row_offsets: torch.Tensor, *,
                      num_slots: int, max_rows: int, kv_len: int) -> RowLayout:
        """Static-shape layout over every cache slot (a slot window from slot 0 of ``num_slots``): each
        request's rows sit in its slot's cell, so attention reads the cache in place instead of
        gathering each request's keys and values (a copy of every layer's cache span per step). No host
        read. Cells of idle slots get dummy queries; a request with more rows than ``max_rows`` (only
        the padding one) attends its first ``max_rows``, its later rows reading back one of those. Slots
        must be distinct between requests that have rows (the scratch slot's empty entries have none)."""
        rows, device = positions.shape[0], positions.device
        slot_of_row, _, step_of_row = _row_coordinates(positions, slot_ids, row_offsets,
                                                       row_offsets[1:] - row_offsets[:-1], max_rows)
        cell = slot_of_row * max_rows + step_of_row
        # (several rows share a cell only past the padding request's bound: any of them will do)
        pad_index = torch.zeros(num_slots * max_rows, dtype=torch.long, device=device)
        pad_index[cell] = torch.arange(rows, device=device)
        valid = torch.zeros(num_slots * max_rows, dtype=torch.bool, device=device)
        valid[cell] = True
        pad_index, valid = pad_index.view(num_slots, max_rows), valid.view(num_slots, max_rows)
        query_positions = torch.where(valid, positions[pad_index], torch.zeros_like(pad_index))
        return cls(pad_index, valid, slot_of_row, query_positions, kv_len, cell, 0)

    def read(self, cache, layer: int, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, kv_heads, kv_len, head_dim]`` of ``layer`` for the padded rows: a
        view of the slot window, or the requests' slots gathered."""
        if self.first_slot is None:
            return cache.read(layer, slot_ids, self.kv_len)
        return cache.window(layer, self.first_slot, int(self.pad_index.shape[0]), self.kv_len)

    def causal_mask(self, kv_len: int | None = None) -> torch.Tensor:
        """Boolean ``[B, 1, R_max, L]``: a query sees keys at positions <= its own."""
        length = self.kv_len if kv_len is None else kv_len
        key_pos = torch.arange(length, device=self.pad_index.device)
        return (key_pos[None, None, None, :] <= self.query_positions[:, None, :, None])

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """Packed ``[G, ...]`` -> padded ``[B, R_max, ...]``."""
        return rows[self.pad_index]

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """Padded ``[B, R_max, ...]`` -> packed ``[G, ...]`` (row order is preserved)."""
        return padded.flatten(0, 1)[self.unpad_index]

    def head_folding(self, heads: int, kv_heads: int) -> HeadFolding:
        """The gathers between packed ``[G, heads, d]`` queries and the folded attention layout
        ``[B, kv_heads, (heads / kv_heads) * R_max, d]`` (see :func:`folded_attention`), for
        :func:`attend`; build it once per forward, not per layer."""
        requests, rows = self.pad_index.shape
        head = torch.arange(heads, device=self.pad_index.device)
        folded = (requests, kv_heads, heads // kv_heads * rows)
        gather_rows = self.pad_index[:, None, :].expand(requests, heads, rows).reshape(folded)
        gather_heads = head[None, :, None].expand(requests, heads, rows).reshape(folded)
        cell, step = self.unpad_index // rows, self.unpad_index % rows
        scatter = ((cell * heads)[:, None] + head[None, :]) * rows + step[:, None]
        return HeadFolding(gather_rows, gather_heads, scatter)


@frozen
class HeadFolding:
    """Indices that take packed queries straight into the folded attention layout and its output
    straight back: one gather each way per layer, where padding then folding (and unfolding then
    unpadding) copy the rows twice more whenever a request has more than one row. The queries are
    indexed by (row, head), so a query view of the fused q/k/v projection is read in place."""

    gather_rows: torch.Tensor  # int64 [B, KV, groups * R_max]: the packed row of each folded query row
    gather_heads: torch.Tensor  # int64 [B, KV, groups * R_max]: its query head
    scatter: torch.Tensor  # int64 [G, H]: rows of the folded output viewed as [B * KV * groups * R_max, d]


def _row_coordinates(positions: torch.Tensor, slot_ids: torch.Tensor, row_offsets: torch.Tensor, counts: torch.Tensor,
                     max_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each packed row's slot, request and step within its request ``[G]``; steps past ``max_rows - 1``
    (a static layout's padding request only: eager layouts fit every request) are clamped to it."""
    rows, device = positions.shape[0], positions.device
    slot_of_row = torch.repeat_interleave(slot_ids, counts, output_size=rows)
    request_of_row = torch.repeat_interleave(torch.arange(counts.shape[0], device=device), counts, output_size=rows)
    step_of_row = (torch.arange(rows, device=device) - row_offsets[request_of_row]).clamp_(max=max_rows - 1)
    return slot_of_row, request_of_row, step_of_row


def _check_request_rows(counts: list[int], slots: list[int], padding_slot: int | None, bound: int) -> None:
    """Raise when a request not on ``padding_slot`` has more rows than a static forward would attend."""
    for request, (count, slot) in enumerate(zip(counts, slots)):
        if count > bound and slot != padding_slot:
            raise ModelError(f"request {request} (slot {slot}) has {count} rows, more than the batch's "
                             f"max_request_rows {bound}")


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
    scores = torch.matmul(q, keys.transpose(-1, -2))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    # mask + scale * scores as one kernel, not a product then a sum over the whole scores tensor (every
    # layer pays for it). The same bits as the two where the scale is a power of two (head_dim 64: 1/8)
    scores = torch.add(mask, scores, alpha=q.shape[-1] ** -0.5)
    return torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)


# The CPU flash-attention kernel (aten::_scaled_dot_product_flash_attention_for_cpu) reduces keys
# in blocks of this many at every query length. Batch-invariant forwards read whole blocks (see
# invariant_kv_length), so a row's blocks, and their bits, do not depend on how many keys the rest
# of the batch needs.
KEY_BLOCK = 512
# A last block shorter than KEY_BLOCK that still gives every row of it the bits a whole block
# gives, where invariant_key_tails() measures so: on the development CPU a row within the first 128
# keys of its block got the same bits from blocks of 128 to 512 keys, and a row past them from
# blocks of 384 to 512, but not from 256 or 320 (the value product sums its keys in another
# grouping). Short contexts then read 128 or 384 keys instead of 512.
SHORT_KEY_TAILS = (128, 384)
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
    """The last-block lengths :func:`invariant_kv_length` may use on this CPU: :data:`SHORT_KEY_TAILS`
    where a check, run once per process, finds that they give rows the bits of whole blocks, none
    otherwise (every block whole). Block lengths change how the kernel's products group their sums,
    which depends on the BLAS build and the CPU, so this is measured rather than assumed."""
    return SHORT_KEY_TAILS if key_tails_invariant(SHORT_KEY_TAILS) else ()


def key_tails_invariant(tails: tuple[int, ...]) -> bool:
    """Whether rows at positions across two blocks get the same bits from every key length that
    :func:`invariant_kv_length` with ``tails`` can give them (rows alone and beside others)."""
    generator = torch.Generator().manual_seed(0)
    kv_heads, groups, head_dim, length = 2, 3, 64, 2 * KEY_BLOCK
    keys, values = (torch.randn(2, kv_heads, length, head_dim, generator=generator) for _ in range(2))
    for position in range(1, length, 13):  # every offset class within a block, in both blocks
        q = torch.randn(2, kv_heads, 2 * groups, head_dim, generator=generator)
        positions = torch.tensor([position - 1, position] * groups)
        reference = None
        for read in sorted({invariant_kv_length(n, length, tails) for n in range(position + 1, length + 1)}):
            mask = torch.zeros(1, 1, positions.shape[0], read).masked_fill_(
                torch.arange(read)[None, None, None, :] > positions[None, None, :, None], float("-inf"))
            out = invariant_attention(q, keys[:, :, :read], values[:, :, :read], mask)
            if reference is not None and not torch.equal(out, reference):
                return False
            reference = out
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


def block_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, S, d]`` over ``keys``/``values`` ``[B, KV, L, d]`` with a boolean
    ``mask`` broadcastable to ``[B, 1, S, L]``; query head ``h`` reads key head ``h // (H / KV)``.

    The draft's block forward: on CUDA at decode sizes the matmul form (as in :func:`attend`, with
    the query heads folded into their key head's rows), elsewhere SDPA with ``enable_gqa``.
    """
    batch, heads, rows, head_dim = q.shape
    kv_heads = keys.shape[1]
    folded = q.reshape(batch, kv_heads, heads // kv_heads * rows, head_dim)
    if not _matmul_attention_for(folded):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=heads != kv_heads)
    additive = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    groups = heads // kv_heads
    if additive.shape[2] != 1:  # a per-row mask repeats for each query head of a group
        additive = additive.repeat(1, 1, groups, 1)
    return matmul_attention(folded, keys, values, additive).reshape(batch, heads, rows, head_dim)


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

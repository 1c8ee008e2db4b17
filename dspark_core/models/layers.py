"""Building blocks shared by the target and the DSpark draft: norms, rotary embedding, products, the MLP.

Attention lives in :mod:`~dspark_core.models.attention`, the packed-row layout it reads in
:mod:`~dspark_core.models.row_layout`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

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


def rope_constants(head_dim: int, theta: float, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`rope_cos_sin` needs besides the positions, float32 ``[head_dim]`` each: every entry's
    angle per position (the inverse frequencies, once per half) and the rotate-half sign (-1 on the
    first half). A model makes them once, where its device is known, and passes them to every
    forward: building them takes about eight device kernels per call, which a captured step would
    replay each time."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    half = head_dim // 2
    sign = torch.cat([torch.full((half,), -1.0, device=device), torch.ones(half, device=device)])
    return torch.cat([inv_freq, inv_freq]), sign


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 constants: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables ``[N, head_dim]`` for :func:`apply_rope` (rotate-half convention): the cosines, and the
    sines with the first half negated (the sign rotate-half gives the second half of each vector when
    it moves to the front), so a layer rotates without negating its own rows. Built once per forward,
    from :func:`rope_constants` (made here when not given)."""
    frequencies, sign = rope_constants(head_dim, theta, positions.device) if constants is None else constants
    angles = positions.float()[:, None] * frequencies[None, :]
    return angles.cos().to(dtype), (angles.sin() * sign).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ([N, heads, head_dim]) by per-row angles (rotate-half layout), with the tables of
    :func:`rope_cos_sin`: ``x * cos + roll(x, half) * signed_sin``. Bit-identical to the textbook
    ``x * cos + cat(-x2, x1) * sin`` (a product's sign is exact), in one device kernel fewer per call:
    the roll replaces the negation and the concatenation (every layer of every step pays for it)."""
    return x * cos[:, None, :] + x.roll(x.shape[-1] // 2, -1) * signed_sin[:, None, :]


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` in place, on ``x`` ``[N, heads, head_dim]`` (a view may do, such as the query
    and key heads of a fused projection's output, which then keeps its value heads beside the keys
    untouched): the same ops in the same order, so the same bits, with one copy (the roll) instead of
    a result tensor. Returns ``x``."""
    rolled = x.roll(x.shape[-1] // 2, -1)
    return x.mul_(cos[:, None, :]).add_(rolled.mul_(signed_sin[:, None, :]))


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
    return product(swiglu_activation(x, gate_up, product), down)


def swiglu_activation(x: torch.Tensor, gate_up: torch.Tensor, product=linear) -> torch.Tensor:
    """The input of a SwiGLU MLP's down projection: ``silu(gate) * up``."""
    gate, up = product(x, gate_up).chunk(2, dim=-1)
    return F.silu(gate) * up


# Where a product's output joins the residual stream, CUDA can add it inside the product: an in-place
# ``addmm_`` is one cuBLAS call (beta = 1) that adds the product into the residual, where ``residual + linear(x, weight)`` launches a product and
# then an add. A target layer has two such products (attention output, MLP down): two kernels fewer per
# layer and step, 60 for SmolLM2. The CPU keeps its packed products (``separate``).
RESIDUAL_PRODUCTS = ("auto", "fused", "separate")
_residual_product = "auto"


def set_residual_product(name: str) -> None:
    """Choose how :func:`residual_linear` adds, process-wide: ``auto`` (the default: inside the product on
    CUDA, after it elsewhere), ``fused`` or ``separate`` everywhere. For tests and benchmarks that run
    the CUDA form on the CPU."""
    global _residual_product
    if name not in RESIDUAL_PRODUCTS:
        raise ValueError(f"residual product {name!r}: choose one of {', '.join(RESIDUAL_PRODUCTS)}")
    _residual_product = name


def residual_linear(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``residual + x @ weight.T`` for packed rows ``x`` ``[G, in]``: where :func:`set_residual_product`
    says so (CUDA by default), added into ``residual`` in place by one ``addmm_`` (the caller owns
    ``residual``: an out-of-place ``addmm`` copies its input into the result first, a kernel of its
    own), else ``residual + linear(x, weight)`` as a new tensor."""
    if _residual_product == "fused" or (_residual_product == "auto" and x.is_cuda):
        return residual.addmm_(x, weight.t())
    return residual + linear(x, weight)

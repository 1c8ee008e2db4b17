"""Greedy tokens without the float32 LM head: a bfloat16 product, a proven bound, a few exact dots.

Why: greedy decoding needs each row's argmax, not its 49 152 logits. On a CPU with native
bfloat16 products (AMX, AVX512-BF16) SmolLM2's float32 LM head and greedy pick take 9.6 ms of a
one-row step and 27 ms of a 46-row one (one thread); this takes 5.9 and 10.4 ms: the bfloat16
product reads half the bytes, at several times the rate.

How, for a row ``h`` (the final-normed hidden state) and the head's rows ``w_v``:

1. ``upper_v``: the bfloat16 product of ``[h, c u |h|]`` with ``[w_v, |w_v|]`` (``u`` = 2^-8,
   bfloat16's unit roundoff). Rounding ``h`` and ``w_v`` to bfloat16, the float32 accumulation and
   the bfloat16 output together move ``h . w_v`` by at most ``3.05 u sum_i |h_i w_vi|``, which is at
   most ``3.05 u |h| |w_v|`` (Cauchy-Schwarz); with ``c`` = :data:`BOUND_FACTOR` > 3.05 the extra
   column makes ``upper_v`` an upper bound of the true logit for every token.
2. The exact logit of ``v*`` = argmax ``upper``, and every token whose upper bound reaches it (less
   the float32 dot error): the row's true argmax is always among them. On SmolLM2's held-out
   answers that is 3 tokens a row at the median and 37 at most (3 149 rows).
3. Each candidate's logit in float32, as the elementwise product of the two rows summed over the
   hidden dimension, and the first index of the largest.

The pick is the first maximum of those float32 dots over the whole vocabulary, whatever the
candidate set, and every dot depends on its own row only: so the tokens are row-invariant, which
batch-invariant verification needs, though the bfloat16 product itself may not be. The dots can
differ from the float32 product's logits in the last bits, so where two tokens tie within rounding
the token may differ from ``argmax`` of ``logits_from_hidden``; target-only and speculative decoding use the
same pick, so they stay identical to each other.

The bound rests on how this CPU's bfloat16 product rounds, so :func:`bound_holds` measures it once
per process and the head is used only where it holds (and the products are native: elsewhere a
bfloat16 product is slower than the float32 one it replaces).
"""

from __future__ import annotations

import functools

import torch

from dspark_core.models.cpu_linear import bfloat16_packed_supported
from dspark_core.models.layers import linear

UNIT_ROUNDOFF = 2.0**-8
# c in the bound column: 3.05 is what the rounding needs; the rest is margin
BOUND_FACTOR = 4.0
# the bound column and zeros: SmolLM2's 576 + 32 columns keep the product's width a multiple of 32,
# as oneDNN's bfloat16 kernels want (577-592 columns took up to 1.8x as long at 46 rows)
_BOUND_COLUMNS = 32
# tokens per block of the candidate search
_BLOCK = 128
# candidate (row, token) pairs whose dots are computed together (8 192 x 576 floats: 19 MB)
_PAIRS_PER_PIECE = 8192

_enabled_override: bool | None = None


def set_enabled(enabled: bool | None) -> None:
    """Force the greedy head on or off (``None``: where :func:`available` says), for tests and benchmarks."""
    global _enabled_override
    _enabled_override = enabled


def enabled() -> bool:
    """Whether float32 CPU targets pick greedy tokens through :class:`GreedyHead`."""
    return available() if _enabled_override is None else _enabled_override


@functools.cache
def available() -> bool:
    """Native bfloat16 products whose rounding keeps the bound (:func:`bound_holds`)."""
    return bfloat16_packed_supported() and bound_holds()


def _dot_error(length: int) -> float:
    """A bound on a float32 dot product's relative error over ``length`` terms (gamma_n, doubled)."""
    n = length * 2.0**-24
    return 2.0 * n / (1.0 - n)


@functools.cache
def bound_holds() -> bool:
    """Measure on this CPU that a bfloat16 product of SmolLM2's head shape stays within 1.5 u of the
    true dot products, relative to ``sum |h_i w_vi|`` (typically 0.8 u): the bound's 3.05 u
    assumes round-to-nearest inputs and output and a float32 accumulator."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4096, 576, generator=generator) * 0.05
    rows = torch.randn(64, 576, generator=generator) * 3.0
    exact = rows.double() @ weight.double().T
    scale = rows.double().abs() @ weight.double().abs().T
    product = linear(rows.to(torch.bfloat16), weight.to(torch.bfloat16)).double()
    return bool(((product - exact).abs() <= 1.5 * UNIT_ROUNDOFF * scale + 1e-30).all())


class GreedyHead:
    """The greedy tokens of a float32 LM head ``weight`` ``[V, d]`` (see the module docstring)."""

    def __init__(self, weight: torch.Tensor) -> None:
        vocab, width = weight.shape
        self.weight = weight
        norms = weight.norm(dim=-1)
        bound_column = torch.zeros(vocab, _BOUND_COLUMNS, dtype=weight.dtype, device=weight.device)
        bound_column[:, 0] = norms
        self.augmented = torch.cat([weight, bound_column], dim=1).to(torch.bfloat16).contiguous()
        # float32 dot error of any token's logit, per unit of |h|
        self.dot_slack = _dot_error(width) * float(norms.max())

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy token of every row of ``hidden`` ``[rows, d]`` (final-normed, float32)."""
        rows, vocab = hidden.shape[0], self.weight.shape[0]
        norms = hidden.norm(dim=-1)
        bound_column = hidden.new_zeros(rows, _BOUND_COLUMNS)
        bound_column[:, 0] = BOUND_FACTOR * UNIT_ROUNDOFF * norms
        product = linear(torch.cat([hidden, bound_column], dim=1).to(torch.bfloat16), self.augmented)
        # in float32 (exact) and in blocks of tokens: one pass finds each block's largest upper
        # bound, and only the few blocks that reach a row's threshold are searched token by token
        blocks = -(-vocab // _BLOCK)
        upper = hidden.new_full((rows, blocks * _BLOCK), float("-inf"))  # padding: never a candidate
        upper[:, :vocab] = product
        upper = upper.view(rows, blocks, _BLOCK)
        block_top = upper.amax(-1)
        every_row = torch.arange(rows, device=hidden.device)
        best_block = block_top.max(-1).indices
        best = best_block * _BLOCK + upper[every_row, best_block].max(-1).indices
        threshold = (hidden * self.weight[best]).sum(-1) - self.dot_slack * norms
        cand_row, cand_block = (block_top >= threshold[:, None]).nonzero(as_tuple=True)
        pair, offset = (upper[cand_row, cand_block] >= threshold[cand_row, None]).nonzero(as_tuple=True)
        row, token = cand_row[pair], cand_block[pair] * _BLOCK + offset
        # in pieces: a row whose logits are all close (a random model) makes every token a candidate,
        # and each dot is computed on its own, so the pieces change no bits
        logits = torch.cat([(hidden[r] * self.weight[t]).sum(-1)
                            for r, t in zip(row.split(_PAIRS_PER_PIECE), token.split(_PAIRS_PER_PIECE))])
        top = torch.full((rows,), float("-inf"), device=hidden.device).scatter_reduce_(0, row, logits, "amax")
        at_top = logits == top[row]
        first = torch.full((rows,), vocab, dtype=torch.long, device=hidden.device)
        return first.scatter_reduce_(0, row[at_top], token[at_top], "amin")

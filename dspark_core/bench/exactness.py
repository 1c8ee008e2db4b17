"""Greedy exactness against target-only decoding, and what a difference means when there is one.

A speculative step computes the target's greedy token at each verified row in
a batch whose shape (rows per request, requests per step) differs from the
one-row-per-request batches of target-only decoding. The arithmetic is the
same up to floating-point rounding, so both runs pick the same token wherever
the target's best token leads its second by more than that rounding noise
(measured on SmolLM2 in float32 on CPU: about 6e-5 in logit units). Where the
two best logits are closer than that, either run may pick either token, and
from there each continues its own, equally greedy, sequence.

:func:`classify` finds the first position where an output leaves the
target-only reference and recomputes the target's logits there (one
cache-free forward over the common prefix): a **near-tie** is a difference
between the target's two best tokens whose logit gap is at most
``tie_margin``; anything else is **real**, i.e. a bug.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from attrs import asdict, frozen

# Default near-tie margin in logit units: ~15x the float32 batch-shape noise measured on SmolLM2.
TIE_MARGIN = 1e-3
# The margin for bfloat16 runs: bfloat16 keeps 8 significant bits, so SmolLM2's logits (magnitudes
# ~10-40) come in steps of 0.03-0.25. On the CPU (12 MT-Bench prompts x 96 tokens, 4 requests at a
# time) every difference between the engine and one-request-at-a-time decoding, target-only or
# speculative, lay between the two best tokens at a gap of at most 0.25 (most at 0-0.125).
TIE_MARGINS = {"float32": TIE_MARGIN, "bfloat16": 0.25}


def tie_margin_for(dtype: str) -> float:
    """The near-tie margin stated for a compute dtype (float32's for an unknown one)."""
    return TIE_MARGINS.get(dtype, TIE_MARGIN)


@frozen
class Divergence:
    """Where one output first differs from the target-only reference, and the target's margin there."""

    prompt: int  # index of the prompt
    position: int  # index into the generated tokens
    expected: int | None  # the reference's token there (None: the reference ended)
    got: int | None  # the output's token there (None: the output ended)
    top2_gap: float  # target's best minus second-best logit after the common prefix
    top2: bool  # the two differing tokens are the target's two best there
    kind: str  # "near-tie" or "real"


def target_only(target, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """Target-only greedy output as the engine reports it: up to ``max_tokens`` tokens, stopping at the
    target's EOS, which (like the engine's stop condition) is not part of the output."""
    from dspark_core.models.reference import greedy_generate

    tokens = greedy_generate(target, prompt, max_tokens)
    if tokens and tokens[-1] in target.config.eos_token_ids:
        tokens = tokens[:-1]
    return tokens


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def next_logits(target, tokens: Sequence[int]) -> torch.Tensor:
    """The target's float32 next-token logits after ``tokens`` (cache-free forward)."""
    from dspark_core.models.reference import full_forward

    logits, _ = full_forward(target, list(tokens))
    return logits[-1].float()


def hold_top_two(logits: torch.Tensor, a: int | None, b: int | None) -> tuple[bool, float]:
    """Whether tokens ``a`` and ``b`` (distinct) hold the two best values of ``logits``, and the gap
    between those two values. With exact ties (frequent in bfloat16, whose logits are coarse) more
    than two tokens may hold them, and any two of those count."""
    values = logits.topk(2).values
    second = float(values[1])
    held = a is not None and b is not None and a != b and float(logits[a]) >= second and float(logits[b]) >= second
    return held, float(values[0] - values[1])


def classify(target, index: int, prompt: Sequence[int], reference: Sequence[int], output: Sequence[int], *,
             tie_margin: float = TIE_MARGIN) -> Divergence | None:
    """None when ``output`` equals ``reference``; else the first divergence, classified."""
    i = first_difference(reference, output)
    if i is None:
        return None
    expected = int(reference[i]) if i < len(reference) else None
    got = int(output[i]) if i < len(output) else None
    top2, gap = hold_top_two(next_logits(target, list(prompt) + list(reference[:i])), expected, got)
    kind = "near-tie" if top2 and gap <= tie_margin else "real"
    return Divergence(index, i, expected, got, gap, top2, kind)


def compare(target, prompts: Sequence[Sequence[int]], references: Sequence[Sequence[int]],
            outputs: Sequence[Sequence[int]], *, tie_margin: float = TIE_MARGIN) -> dict[str, Any]:
    """Every prompt's output against its reference: counts and the classified divergences."""
    divergences = [d for i, (p, r, o) in enumerate(zip(prompts, references, outputs, strict=True))
                   if (d := classify(target, i, p, r, o, tie_margin=tie_margin)) is not None]
    tokens = sum(len(r) for r in references)
    return {
        "prompts": len(prompts), "reference_tokens": tokens,
        "identical": len(prompts) - len(divergences),
        "near_tie": sum(d.kind == "near-tie" for d in divergences),
        "real": sum(d.kind == "real" for d in divergences),
        # tokens before the first divergence, over all prompts: how much of the reference was reproduced
        "matching_prefix_tokens": tokens - sum(len(references[d.prompt]) - d.position for d in divergences),
        "divergences": [asdict(d) for d in divergences],
    }

"""Batch-invariant target forwards on the real SmolLM2: are they invariant, and what do they cost?

Part one checks the property greedy exactness needs. Sixteen random prompts are prefilled, then
the logits of their next eight positions are computed three ways: every request's eight rows in
one forward with all sixteen requests (a verify step), each request's eight rows alone, and one
row per request and forward (target-only decoding). It reports the share of rows whose logits
are bit-identical to the last way, and whether their greedy tokens agree, with the invariant
kernels off and on.

Part two times one target forward with the kernels off and on, alternating on one model, at 1
and 16 requests with 1 to 8 rows each (contexts of 250 tokens, one thread).

    python benchmarks/batch_invariance.py --dtype bfloat16 --output results/amx/batch-invariance-bf16.json

``--device=cuda`` runs both parts on a GPU, where the engine does not use these kernels yet (a
target refuses them off the CPU): whether they are invariant there, and at what cost, is what a
GPU sitting would measure with it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import write_results

from dspark_core.models.base import make_forward_batch
from dspark_core.models.attention import KEY_BLOCK
from dspark_core.models.loading import load_target


def whole_blocks(length: int) -> int:
    """A cache length of whole attention key blocks, as serving's (2 048) is."""
    return -(-length // KEY_BLOCK) * KEY_BLOCK


def use_invariant(model, on: bool) -> None:
    model.batch_invariant = on  # the forward and new caches follow it


def invariance(model, requests: int, context: int, rows: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, 40000, (context,), generator=generator).tolist() for _ in range(requests)]
    drafted = [torch.randint(100, 40000, (rows,), generator=generator).tolist() for _ in range(requests)]
    slots = list(range(requests))

    def fresh():
        cache = model.new_cache(requests + 1, whole_blocks(context + rows + 8))
        for b in slots:
            model.forward(make_forward_batch([prompts[b]], [0], [b], device=model.device), cache)
        return cache

    cache = fresh()
    verify = model.forward(make_forward_batch(drafted, [context] * requests, slots, device=model.device), cache).logits.view(requests, rows, -1)
    cache = fresh()
    alone = torch.stack([model.forward(make_forward_batch([drafted[b]], [context], [b], device=model.device), cache).logits for b in slots])
    cache = fresh()
    single = torch.stack([torch.stack([model.forward(make_forward_batch([[drafted[b][r]]], [context + r], [b], device=model.device), cache).logits[0]
                                       for r in range(rows)]) for b in slots])
    result = {}
    for name, logits in (("verify_step", verify), ("request_alone", alone)):
        result[name] = {"identical_rows": float((logits == single).all(-1).float().mean()),
                        "max_abs_diff": float((logits - single).abs().max()),
                        "greedy_agree": float((logits.argmax(-1) == single.argmax(-1)).float().mean())}
    return result


def timings(model, context: int, repeats: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (context,), generator=generator).tolist() for _ in range(16)]
    caches = {}
    for on in (False, True):
        use_invariant(model, on)
        caches[on] = model.new_cache(17, whole_blocks(context + 16))
        for b in range(16):
            model.forward(make_forward_batch([prompts[b]], [0], [b], device=model.device), caches[on])
    out = []
    for requests, rows in ((1, 1), (1, 4), (1, 8), (16, 1), (16, 2), (16, 4), (16, 8)):
        batch = make_forward_batch([[5] * rows] * requests, [context] * requests, list(range(requests)), device=model.device)
        spent: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):  # alternate, so machine noise falls on both alike
            for on in (False, True):
                use_invariant(model, on)
                started = time.perf_counter()
                model.forward(batch, caches[on])
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                spent[on].append(time.perf_counter() - started)
        off, on_ = (statistics.median(spent[k]) * 1e3 for k in (False, True))
        out.append({"requests": requests, "rows_per_request": rows, "default_ms": round(off, 2), "invariant_ms": round(on_, 2),
                    "ratio": round(on_ / off, 3)})
        print(out[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--context", type=int, default=250)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="Torch device of the target (cpu, cuda).")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_target("smollm2", device=args.device, dtype=getattr(torch, args.dtype))
    checks = {}
    for on in (False, True):
        use_invariant(model, on)
        checks["invariant" if on else "default"] = invariance(model, 16, 120, 8, seed=0)
        print("invariant" if on else "default", checks["invariant" if on else "default"])
    results = [{"check": name, **value} for name, value in checks.items()] + timings(model, args.context, args.repeats)
    write_results(args.output, "batch_invariance.py",
                  {"dtype": args.dtype, "threads": args.threads, "context": args.context, "device": args.device}, results)


if __name__ == "__main__":
    main()

"""Target-only greedy decode throughput of a real model on this machine.

    python benchmarks/model_decode.py --model=smollm2 --batch 1 16 --tokens 32

Reports the model load time and, per batch size, decode tokens/s (all
requests together, prefill excluded) as one JSON object. ``--count_ops`` adds
the number of aten operator calls in one decode forward per batch size (under
the torch profiler, outside the timed steps): on a GPU each is at least one
kernel, so it is the floor of a step's kernel count.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dspark_core.models.base import make_forward_batch
from dspark_core.models.loading import load_target


def decode_rate(model, batch: int, tokens: int, prompt_len: int) -> float:
    """Tokens per second of ``tokens`` single-row decode steps for ``batch`` requests."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).tolist()
    cache = model.new_cache(batch, prompt_len + tokens + 1)
    slots = list(range(batch))
    logits = model.forward(make_forward_batch(prompts, [0] * batch, slots), cache).logits
    last = logits[make_forward_batch(prompts, [0] * batch, slots).row_offsets[1:] - 1].argmax(-1).tolist()
    start = time.perf_counter()
    for step in range(tokens):
        out = model.forward(make_forward_batch([[t] for t in last], [prompt_len + step] * batch, slots), cache)
        last = out.logits.argmax(-1).tolist()
    return batch * tokens / (time.perf_counter() - start)


def ops_per_forward(model, batch: int, prompt_len: int) -> int:
    """aten operator calls (outermost only) in one decode forward of ``batch`` single-row requests."""
    cache = model.new_cache(batch, prompt_len + 2)
    slots = list(range(batch))
    prompts = [[1] * prompt_len for _ in range(batch)]
    model.forward(make_forward_batch(prompts, [0] * batch, slots), cache)
    step = make_forward_batch([[1]] * batch, [prompt_len] * batch, slots)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model.forward(step, cache)
    events = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    return len(events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt_len", type=int, default=64)
    parser.add_argument("--count_ops", action="store_true", help="Also count aten calls per decode forward.")
    args = parser.parse_args()
    start = time.perf_counter()
    model = load_target(args.model)
    load_s = time.perf_counter() - start
    rates = {str(b): round(decode_rate(model, b, args.tokens, args.prompt_len), 1) for b in args.batch}
    report = {"model": args.model, "load_seconds": round(load_s, 2), "threads": torch.get_num_threads(),
              "prompt_len": args.prompt_len, "decode_tokens": args.tokens, "tokens_per_second": rates}
    if args.count_ops:
        report["aten_calls_per_forward"] = {str(b): ops_per_forward(model, b, args.prompt_len) for b in args.batch}
    print(json.dumps(report))


if __name__ == "__main__":
    main()

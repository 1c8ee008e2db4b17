"""Schedule overlap on vs off: output tokens/s at concurrency 1 and 16 on SmolLM2, one interleaved run.

    python benchmarks/overlap.py [--draft_model DIR] [--max_tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import time

from common import load_draft_model, load_models, make_engine, mtbench_chats, set_threads

from dspark_core.engine.request import SamplingParams


def throughput(engine, prompts, concurrency: int, max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=max_tokens)
    pending, live, tokens = list(prompts), [], 0
    started = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            live.append(engine.add_request(pending.pop(0), params))
        for output in engine.step():
            tokens += len(output.token_ids)
        live = [r for r in live if r.finish_reason is None]
    return tokens / (time.perf_counter() - started), tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--draft_model", default="default")
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    set_threads(args.threads)
    target, _ = load_models(None)
    # one draft instance per engine: a draft holds the context cache of one engine
    engines = {overlap: make_engine(target, load_draft_model(args.draft_model), policy="fixed", overlap=overlap)
               for overlap in (False, True)}
    results = {}
    for concurrency, count in ((1, 4), (16, 16)):
        prompts = mtbench_chats(count)
        rates = {False: [], True: []}
        for r in range(args.rounds):
            for overlap in ((False, True) if r % 2 == 0 else (True, False)):
                rate, _ = throughput(engines[overlap], prompts, concurrency, args.max_tokens)
                rates[overlap].append(rate)
        on, off = sum(rates[True]) / len(rates[True]), sum(rates[False]) / len(rates[False])
        results[concurrency] = {"overlap_on_tok_s": round(on, 2), "overlap_off_tok_s": round(off, 2),
                                "ratio_on_over_off": round(on / off, 3)}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

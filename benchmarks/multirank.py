"""Decode throughput of the same service on 1 rank and on 2 tensor-parallel ranks (this machine, loopback).

    python benchmarks/multirank.py --model=smollm2 --requests 4 --max_tokens 32
    python benchmarks/multirank.py --model=tiny

Every configuration runs in fresh processes (one torch thread per rank unless
``--threads`` says otherwise): the 1-rank run builds its engine the ordinary
way, the 2-rank run goes through ``dspark_core.distributed.launch.start_rank``
with gloo on 127.0.0.1. Both decode the same random prompts with the
fixed-width DSpark policy and a random draft shaped for the target (speed, not
acceptance, is measured), after one short warm-up generation. Prints one JSON
object: committed tokens/s per rank count, the 2-vs-1 ratio, and whether the
2-rank tokens equal the 1-rank tokens.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def prepare_checkpoints(model: str, root: Path, width: int) -> tuple[str, Path]:
    """The target path/alias and a random DSpark draft directory for it."""
    from dspark_core.models.random_models import random_draft
    from dspark_core.models.speculators_io import save_draft

    if model == "tiny":
        sys.path.insert(0, str(REPO / "tests"))
        from checkpoint_support import write_tiny_pair

        target, draft = write_tiny_pair(root, block_size=width)
        return str(target), draft
    from dspark_core.models.loading import load_target

    config = load_target(model).config
    draft = root / "draft"
    save_draft(random_draft(config, seed=0, block_size=width), draft)
    return model, draft


def run_rank(rank: int, nnodes: int, argv: list[str], prompts, max_tokens: int, threads: int, results) -> None:
    torch.set_num_threads(threads)
    from dspark_core.calibration.install import bring_up
    from dspark_core.config import parse_serve_args
    from dspark_core.engine.request import SamplingParams

    try:
        config = parse_serve_args([*argv, f"--nnodes={nnodes}", f"--node_rank={rank}"])
        if nnodes == 1:
            from dspark_core.startup import build_engine, resolve_launch

            launch = resolve_launch(config)
            engine = build_engine(launch)
            bring_up(engine, launch, progress=False)
            handle = None
        else:
            from dspark_core.distributed.launch import start_rank

            handle = start_rank(config)
            handle.bring_up()
            engine = handle.engine
            if rank != 0:
                results.put((rank, None, handle.run_worker()))
                return
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        engine.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm the allocator and caches
        started = time.perf_counter()
        outputs = engine.generate(prompts, params)
        seconds = time.perf_counter() - started
        tokens = [list(o.token_ids) for o in outputs]
        if handle is not None:
            handle.close()
        else:
            engine.close()
        results.put((rank, {"seconds": seconds, "tokens": sum(len(t) for t in tokens)}, tokens))
    except Exception as exc:  # reported to the parent, which fails loudly
        results.put((rank, {"error": f"{type(exc).__name__}: {exc}"}, None))


def measure(nnodes: int, argv: list[str], prompts, max_tokens: int, threads: int) -> tuple[dict, list]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [*argv, f"--master_node_addr=127.0.0.1:{port}"]
    procs = [ctx.Process(target=run_rank, args=(r, nnodes, argv, prompts, max_tokens, threads, results)) for r in range(nnodes)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, info, tokens = results.get(timeout=1800)
        got[rank] = (info, tokens)
    for p in procs:
        p.join(60)
    info, tokens = got[0]
    if "error" in info:
        raise SystemExit(f"{nnodes}-rank run failed: {info['error']}")
    return {"tokens_per_second": round(info["tokens"] / info["seconds"], 2), "seconds": round(info["seconds"], 2),
            "tokens": info["tokens"]}, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a target path or alias, or `tiny` for the test checkpoint")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--width", type=int, default=5, choices=[5, 7])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = prepare_checkpoints(args.model, Path(tmp), args.width)
        from dspark_core.models.loading import load_target

        vocab = load_target(target).config.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, vocab, (args.requests, args.prompt_len), generator=g).tolist()
        argv = [f"--model={target}", f"--draft_model={draft}", f"--num_speculative_tokens={args.width}",
                "--enable_adaptive_speculative_decode=false", f"--max_seqs_per_batch={max(args.requests, 1)}",
                f"--max_model_len={args.prompt_len + args.max_tokens + 4 * (args.width + 1)}"]
        one, tokens_one = measure(1, argv, prompts, args.max_tokens, args.threads)
        two, tokens_two = measure(2, argv, prompts, args.max_tokens, args.threads)
    print(json.dumps({
        "model": args.model, "requests": args.requests, "max_tokens": args.max_tokens, "prompt_len": args.prompt_len,
        "draft_width": args.width, "threads_per_rank": args.threads, "policy": "fixed", "one_rank": one, "two_ranks": two,
        "ratio_two_over_one": round(two["tokens_per_second"] / one["tokens_per_second"], 3),
        "same_tokens": tokens_one == tokens_two,
    }))


if __name__ == "__main__":
    main()

"""``dspark-core generate``: target-only greedy completion (the exactness reference)."""

from __future__ import annotations

import argparse
import json
import time

import torch

from dspark_core.errors import ModelError

NAME = "generate"
HELP = "Greedy completion of one prompt by the target model alone (no draft, no speculation)."

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="GGUF file, Hugging Face directory or alias (smollm2). Default: smollm2.")
    parser.add_argument("--prompt", required=True, help="Prompt text.")
    parser.add_argument("--chat", action="store_true", help="Wrap the prompt as one user turn with the model's chat template.")
    parser.add_argument("--max_tokens", type=int, default=64, help="Most new tokens to generate (stops earlier at EOS). Default: 64.")
    parser.add_argument("--device", default="cpu", help="Torch device. Default: cpu.")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="Weight dtype. Default: float32.")
    parser.add_argument("--plugin", action="append", default=[], metavar="NAME_OR_MODULE", help="Extra plugin to load (repeatable), e.g. another model family.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object (text, token ids, timings) instead of the text.")


def run(args: argparse.Namespace) -> int:
    from dspark_core.models.loading import load_target
    from dspark_core.models.reference import greedy_generate
    from dspark_core.plugins import load_hooks

    if args.max_tokens < 1:
        raise ModelError(f"--max_tokens must be >= 1, got {args.max_tokens}")
    started = time.perf_counter()
    model = load_target(args.model, device=args.device, dtype=_DTYPES[args.dtype], hooks=load_hooks(args.plugin))
    loaded = time.perf_counter()
    tok = model.tokenizer
    prompt_ids = tok.encode_chat(args.prompt) if args.chat else tok.encode(args.prompt)
    if not prompt_ids:
        raise ModelError("the prompt encodes to no tokens")
    if len(prompt_ids) + args.max_tokens > model.config.max_position:
        raise ModelError(f"prompt ({len(prompt_ids)} tokens) plus --max_tokens {args.max_tokens} exceeds the context limit {model.config.max_position}")
    out = greedy_generate(model, prompt_ids, args.max_tokens)
    done = time.perf_counter()
    text = tok.decode(out)
    if args.json:
        finish = "stop" if out and out[-1] in model.config.eos_token_ids else "length"
        print(json.dumps({
            "model": str(args.model), "text": text, "token_ids": out, "prompt_token_ids": prompt_ids,
            "finish_reason": finish, "load_seconds": round(loaded - started, 3), "generate_seconds": round(done - loaded, 3),
        }))
    else:
        print(text)
    return 0

"""``dspark-core generate``: greedy completions through the engine, with speculation statistics."""

from __future__ import annotations

import argparse
import json
import time

import torch

from dspark_core.errors import ConfigError
from dspark_core.prompts import read_prompts_jsonl

NAME = "generate"
HELP = "Greedy completions of one prompt or a JSONL file of prompts (target alone, or with a DSpark draft)."

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="GGUF file, Hugging Face directory or alias (smollm2).")
    parser.add_argument("--draft_model", default=None,
                        help="DSpark draft directory, or `default` for the draft shipped for the target. Omit for target-only.")
    parser.add_argument("--num_speculative_tokens", type=int, default=7, help="Draft width K.")
    parser.add_argument("--policy", default=None,
                        help="Budget policy (adaptive, fixed, none, or a plugin's). Default: fixed with a draft, none without.")
    parser.add_argument("--policy_options", default="{}", help='JSON options for the policy, e.g. \'{"k": 3}\'.')
    parser.add_argument("--copy_proposals", choices=["auto", "on", "off"], default="auto",
                        help="Copy proposals, as serve's flag (auto: as the draft's config says).")
    parser.add_argument("--cost_table", default=None, help="Cost table for the adaptive policy (without one it verifies full width).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="Prompt text.")
    source.add_argument("--prompts", help="JSONL file, one object per line with `prompt` (raw text) or `messages` (chat).")
    parser.add_argument("--chat", action="store_true", help="Wrap --prompt as one user turn with the model's chat template.")
    parser.add_argument("--max_tokens", type=int, default=64, help="Most new tokens per prompt (stops earlier at EOS).")
    parser.add_argument("--max_batch", type=int, default=16, help="Largest request bucket (prompts decoded together).")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda, cuda:N, npu or auto; the device plugin says when one is not usable here. "
                             "Default: cpu (serve and bench default to auto).")
    parser.add_argument("--dtype", choices=["auto", *sorted(_DTYPES)], default="auto",
                        help="Compute dtype, as serve's flag (`auto`: the device's default, float32 on CPU and CUDA).")
    parser.add_argument("--draft_dtype", choices=["auto", *sorted(_DTYPES)], default="auto",
                        help="Draft compute dtype, as serve's flag (`auto`: the device's draft default, bfloat16 on CPUs "
                             "with native bfloat16 products, else --dtype). Never changes the output.")
    parser.add_argument("--plugin", action="append", default=[], metavar="NAME_OR_MODULE", help="Extra plugin (repeatable).")
    parser.add_argument("--json", action="store_true", help="Print one JSON object with every completion and its statistics.")


def build_engine(args: argparse.Namespace):
    """The engine for these flags; ``--dtype``/``--draft_dtype`` `auto` resolve as serve resolves them."""
    from dspark_core.engine.engine import Engine, EngineConfig
    from dspark_core.geometry import default_request_buckets
    from dspark_core.models.drafts import default_draft_path
    from dspark_core.models.loading import load_target
    from dspark_core.models.speculators_io import load_draft
    from dspark_core.device import resolve_draft_dtype, resolve_dtype
    from dspark_core.plugins import load_hooks
    from dspark_core.resolve import pick_device
    from dspark_core.table import load_table

    hooks = load_hooks(args.plugin)
    # the device plugin refuses a device this machine cannot use, before any weight is loaded
    spec = pick_device(hooks, args.device.split(":")[0])
    device = args.device if ":" in args.device else spec.torch_device
    dtype_name = resolve_dtype(getattr(args, "dtype", "auto"), spec)
    draft_dtype_name = resolve_draft_dtype(getattr(args, "draft_dtype", "auto"), spec, dtype_name)
    for flag, name in (("--dtype", dtype_name), ("--draft_dtype", draft_dtype_name)):
        if name not in _DTYPES:  # a plugin device's default this command cannot run
            raise ConfigError(f"{flag}=auto: device {spec.name!r} defaults to {name}; choose one of {', '.join(sorted(_DTYPES))}")
    dtype, draft_dtype = _DTYPES[dtype_name], _DTYPES[draft_dtype_name]
    args.dtype, args.draft_dtype = dtype_name, draft_dtype_name  # resolved, for the report
    policy = args.policy or ("fixed" if args.draft_model else "none")
    try:
        options = json.loads(args.policy_options)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--policy_options: not valid JSON ({exc.msg})") from None
    if not isinstance(options, dict):
        raise ConfigError(f"--policy_options: must be a JSON object, got {args.policy_options!r}")
    hooks.budget_policy(policy, options)  # a misspelt policy or a bad option fails before the models load
    target = load_target(args.model, device=device, dtype=dtype, hooks=hooks)
    draft = None
    if args.draft_model:
        path = default_draft_path(args.model) if args.draft_model == "default" else args.draft_model
        draft = load_draft(path, device=device, dtype=draft_dtype)
    config = EngineConfig(draft_width=args.num_speculative_tokens, policy=policy, policy_options=options,
                          request_buckets=default_request_buckets(args.max_batch), copy_proposals=args.copy_proposals)
    engine = Engine(target, draft, config, hooks=hooks)
    if args.cost_table:
        engine.install_table(load_table(args.cost_table, hooks.cost_model))
    return engine


def run(args: argparse.Namespace) -> int:
    from dspark_core.engine.request import SamplingParams

    if args.max_tokens < 1:
        raise ConfigError(f"--max_tokens must be >= 1, got {args.max_tokens}")
    width = args.num_speculative_tokens  # without a draft it is never used, but must not be negative
    if width < 0:
        raise ConfigError(f"--num_speculative_tokens must be >= 0, got {width}")
    if args.draft_model and width < 1:
        raise ConfigError(f"--num_speculative_tokens must be >= 1 with a draft, got {width} "
                          "(omit --draft_model to decode with the target alone)")
    if args.max_batch < 1:
        raise ConfigError(f"--max_batch must be >= 1, got {args.max_batch}")
    if args.prompts:  # (read first: a bad file fails before the models load)
        prompts = read_prompts_jsonl(args.prompts)
    else:
        prompts = [[{"role": "user", "content": args.prompt}]] if args.chat else [args.prompt]
    started = time.perf_counter()
    engine = build_engine(args)
    loaded = time.perf_counter()
    from tqdm import tqdm

    # a prompts file may take minutes: a bar on stderr counts the finished requests
    with tqdm(total=len(prompts), desc="generate", unit="prompt", disable=args.json or len(prompts) < 2) as bar:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens), finished=lambda _: bar.update())
    done = time.perf_counter()
    engine.close()
    if not args.json:
        for output in outputs:
            print(output.text)
        return 0
    tokens = sum(len(o.token_ids) for o in outputs)
    print(json.dumps({
        "model": str(args.model), "policy": engine.policy.name, "num_speculative_tokens": engine.config.draft_width,
        # the dtypes the models computed in, read from their weights (the flags may say auto)
        "dtype": str(engine.runner.target.dtype).removeprefix("torch."), "draft_dtype": engine.runner.draft_dtype,
        "load_seconds": round(loaded - started, 3), "generate_seconds": round(done - loaded, 3),
        "output_tokens_per_second": round(tokens / max(done - loaded, 1e-9), 2),
        "completions": [{
            "text": o.text, "token_ids": list(o.token_ids), "prompt_tokens": o.prompt_tokens,
            "finish_reason": o.finish_reason, "steps": o.steps, "acceptance": round(o.acceptance, 4),
            "accepted_length": round(o.accepted_length, 4), "verify_widths": list(o.verify_widths),
            "draft_off_steps": o.draft_off_steps,
        } for o in outputs],
    }))
    return 0

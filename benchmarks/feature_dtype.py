"""How far bfloat16 teacher features are from the float32 ones serving computes.

``train-draft --dtype=bfloat16`` runs the frozen target in bfloat16 to make
features ~1.5x faster on an AVX512-BF16 CPU. This script measures what that
costs the labels, on the same ShareGPT pairs through both dtypes:

* the share of positions whose teacher top-1 token agrees (a disagreement is
  a label the float32 engine would not verify);
* the median relative error of each auxiliary hidden state (what the draft's
  context injection reads);
* the mean absolute difference of the teacher's top-1 probability.

    python benchmarks/feature_dtype.py --pairs=32 --threads=2
"""

from __future__ import annotations

import argparse
import json

import torch

from dspark_core.models.loading import load_target
from dspark_core.train import data
from dspark_core.train.features import compute_features
from dspark_core.train.train import make_draft_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--pairs", type=int, default=32, help="ShareGPT pairs compared.")
    parser.add_argument("--offset", type=int, default=16, help="Skip this many pairs of the seeded order first.")
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    reference = load_target(args.target, device=cpu, dtype=torch.float32)
    low = load_target(args.target, device=cpu, dtype=torch.bfloat16)
    aux = make_draft_config(reference.config).aux_layer_ids
    pairs = [data.tokenize_pair(reference.tokenizer, prompt, answer, args.max_tokens)
             for prompt, answer in data.sharegpt_pairs(None, limit=args.offset + args.pairs, seed=0, max_chars=500)[args.offset :]]
    exact = compute_features(reference, pairs, aux, k=16, rows_per_forward=4096, progress=False)
    rough = compute_features(low, pairs, aux, k=16, rows_per_forward=4096, progress=False)
    width = exact.hidden.shape[1] // len(aux)
    hidden_error = {}
    for n, layer in enumerate(aux):
        x = exact.hidden[:, n * width : (n + 1) * width].float()
        y = rough.hidden[:, n * width : (n + 1) * width].float()
        hidden_error[str(layer)] = round(float(((x - y).norm(dim=1) / x.norm(dim=1)).median()), 4)
    report = {
        "rows": int(exact.tokens.numel()),
        "top1_agreement": round(float((exact.topk_ids[:, 0] == rough.topk_ids[:, 0]).float().mean()), 4),
        "aux_hidden_median_relative_error": hidden_error,
        "top1_probability_mean_abs_diff": round(float((exact.topk_probs[:, 0].float() - rough.topk_probs[:, 0].float()).abs().mean()), 4),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Write an untrained (randomly initialised) DSpark draft shaped like the shipped SmolLM2 draft.

The bench's worst case: a draft whose proposals are almost never accepted and
whose confidence head says nothing useful. Adaptive decoding must still not
lose to target-only decoding with it (docs/plugins.md, draft-off steps).

    python benchmarks/untrained_draft.py /tmp/untrained-draft
    dspark-core bench --draft_model=/tmp/untrained-draft --policies=adaptive,none,fixed
"""

from __future__ import annotations

import argparse

import torch

from dspark_core.models.drafts import default_draft_path
from dspark_core.models.speculators_io import load_draft, save_draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="Directory to write config.json + model.safetensors into.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    draft = load_draft(default_draft_path("smollm2"))  # same config, vocabulary map and shapes
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:  # small random weights: a plausible "before training" draft
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        if hasattr(draft, "temperatures"):
            draft.temperatures.fill_(1.0)
    print(save_draft(draft, args.output_dir))


if __name__ == "__main__":
    main()

"""Shared setup for the benchmark scripts: SmolLM2 + the shipped draft, MT-Bench prompts."""

from __future__ import annotations

import torch

from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.geometry import Geometry


def load_models(draft_path: str | None = "default", draft_dtype: torch.dtype | None = None):
    """The real default target and a draft (the shipped one unless a directory is given, none for
    ``None``; float32 unless ``draft_dtype`` says otherwise)."""
    from dspark_core.models.loading import load_target

    return load_target("smollm2"), None if draft_path is None else load_draft_model(draft_path, draft_dtype)


def load_draft_model(draft_path: str = "default", draft_dtype: torch.dtype | None = None):
    """A fresh draft instance. Engines that run side by side each need their own: a draft holds the
    context (its KV cache) of the last engine built with it, so two engines sharing one overwrite
    each other's draft context and propose from the wrong one (still exact, but less accepted)."""
    from dspark_core.models.drafts import resolve_draft_path
    from dspark_core.models.speculators_io import load_draft

    draft_path = resolve_draft_path(draft_path, "smollm2")
    return load_draft(draft_path) if draft_dtype is None else load_draft(draft_path, dtype=draft_dtype)


def mtbench_chats(count: int) -> list:
    from dspark_core.train.data import mtbench_first_turns

    return [[{"role": "user", "content": q}] for q in mtbench_first_turns()[:count]]


def make_engine(target, draft, *, width: int = 7, policy: str = "adaptive", overlap: bool = True,
                buckets=(1, 2, 4, 8, 16), table=None, policy_options=None, max_model_len: int = 1024) -> Engine:
    engine = Engine(target, draft, EngineConfig(draft_width=width, policy=policy, policy_options=policy_options or {},
                                                request_buckets=buckets, max_model_len=max_model_len,
                                                schedule_overlap=overlap),
                    geometry=Geometry.bucket_multiples(width, buckets))
    if table is not None:
        engine.install_table(table)
    return engine


def set_threads(n: int) -> None:
    torch.set_num_threads(n)


def write_results(path: str | None, script: str, meta: dict, results: list[dict]) -> None:
    """Write ``{"meta", "results"}`` JSON to ``path`` (nothing without one); meta gains torch and the command."""
    if not path:
        return
    import json
    import sys
    from pathlib import Path

    meta = {**meta, "torch": torch.__version__, "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:])}
    Path(path).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")

"""Load and save DSpark drafts in the vLLM *speculators* format.

A checkpoint is a directory with ``config.json`` (``speculators_model_type:
"dspark"``) and ``model.safetensors``. It is also dspark-core's own format for
drafts it trains; fields speculators does not know (the STS temperatures) live
under the ``"dspark_core"`` key of config.json, which other readers ignore.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspark_core.errors import ModelError
from dspark_core.models.draft_config import DraftConfig
from dspark_core.models.dspark_draft import DSparkDraft
from dspark_core.models.hf_loader import read_json, read_safetensors_dir

PROJECT_KEY = "dspark_core"
WEIGHTS_FILE = "model.safetensors"
# Weights a speculators checkpoint may carry that dspark-core takes from the target instead.
_IGNORED = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}


def _get(cfg: dict[str, Any], key: str, path: Path, where: str = "") -> Any:
    if key not in cfg:
        raise ModelError(f"{path}: config field {where}{key!r} is missing")
    return cfg[key]


def _sample_from_anchor(cfg: dict[str, Any], block_size: int) -> bool:
    if "sample_from_anchor" in cfg:
        return bool(cfg["sample_from_anchor"])
    # Older files: K = block_size when the anchor slot proposes, block_size - 1 otherwise.
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or []
    if methods and "speculative_tokens" in methods[0]:
        return int(methods[0]["speculative_tokens"]) == block_size
    return True  # the DSpark default


def config_from_speculators(cfg: dict[str, Any], path: Path) -> DraftConfig:
    """Translate a speculators ``dspark`` config.json into a :class:`DraftConfig`."""
    kind = _get(cfg, "speculators_model_type", path)
    if kind != "dspark":
        raise ModelError(f"{path}: speculators_model_type is {kind!r}, expected 'dspark'")
    tl = _get(cfg, "transformer_layer_config", path)
    if not isinstance(tl, dict):
        raise ModelError(f"{path}: transformer_layer_config must be an object")
    w = "transformer_layer_config."
    d = int(_get(tl, "hidden_size", path, w))
    heads = int(_get(tl, "num_attention_heads", path, w))
    rope = tl.get("rope_parameters") or {}
    block = int(_get(cfg, "block_size", path))
    extras = cfg.get(PROJECT_KEY) or {}
    try:
        return DraftConfig(
            hidden_size=d,
            intermediate_size=int(_get(tl, "intermediate_size", path, w)),
            num_layers=int(_get(tl, "num_hidden_layers", path, w)),
            num_heads=heads,
            num_kv_heads=int(tl.get("num_key_value_heads") or heads),
            head_dim=int(tl.get("head_dim") or d // heads),
            target_vocab_size=int(_get(tl, "vocab_size", path, w)),
            draft_vocab_size=int(_get(cfg, "draft_vocab_size", path)),
            block_size=block,
            aux_layer_ids=tuple(int(i) for i in _get(cfg, "aux_hidden_state_layer_ids", path)),
            mask_token_id=int(_get(cfg, "mask_token_id", path)),
            target_hidden_size=int(cfg.get("target_hidden_size") or d),
            rms_eps=float(tl.get("rms_norm_eps", 1e-6)),
            rope_theta=float(tl.get("rope_theta", rope.get("rope_theta", 1_000_000.0))),
            max_position=int(tl.get("max_position_embeddings", 40960)),
            attention_bias=bool(tl.get("attention_bias", False)),
            markov_rank=int(cfg.get("markov_rank", 256)),
            markov_head_type=str(cfg.get("markov_head_type", "vanilla")),
            enable_confidence_head=bool(cfg.get("enable_confidence_head", True)),
            confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", True)),
            sample_from_anchor=_sample_from_anchor(cfg, block),
            sts_temperatures=extras.get("sts_temperatures"),
            copy_order=int(extras.get("copy_order", 0)),
            copy_min_order=None if extras.get("copy_min_order") is None else int(extras["copy_min_order"]),
            copy_confidences=extras.get("copy_confidences"),
        )
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{path}: bad value in config ({exc})") from None


def config_to_speculators(c: DraftConfig, verifier: str | None = None) -> dict[str, Any]:
    """The config.json dict of a draft (inverse of :func:`config_from_speculators`)."""
    data: dict[str, Any] = {
        "architectures": ["DSparkSpeculator"],
        "speculators_model_type": "dspark",
        "transformer_layer_config": {
            "model_type": "qwen3", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "vocab_size": c.target_vocab_size, "rms_norm_eps": c.rms_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position, "attention_bias": c.attention_bias, "hidden_act": "silu",
        },
        "draft_vocab_size": c.draft_vocab_size,
        "block_size": c.block_size,
        "target_hidden_size": c.target_hidden_size,
        "aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "mask_token_id": c.mask_token_id,
        "sample_from_anchor": c.sample_from_anchor,
        "markov_rank": c.markov_rank,
        "markov_head_type": c.markov_head_type,
        "enable_confidence_head": c.enable_confidence_head,
        "confidence_head_with_markov": c.confidence_head_with_markov,
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.num_speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier},
        },
    }
    extras: dict[str, Any] = {}
    if c.sts_temperatures is not None:
        extras["sts_temperatures"] = list(c.sts_temperatures)
    if c.copy_order:
        extras["copy_order"] = c.copy_order
    if c.copy_min_order is not None:
        extras["copy_min_order"] = c.copy_min_order
    if c.copy_confidences is not None:
        extras["copy_confidences"] = [list(row) for row in c.copy_confidences]
    if extras:
        data[PROJECT_KEY] = extras
    return data


def _load_weights(draft: DSparkDraft, tensors: dict[str, torch.Tensor], directory: Path) -> None:
    c = draft.config
    expected = draft.state_dict()
    for key in ("d2t", "t2d"):  # identity mappings of a full-vocabulary draft: ignored like speculators does
        if key not in expected:
            tensors.pop(key, None)
    if "lm_head.weight" in tensors:
        head = tensors.pop("lm_head.weight")
        if tuple(head.shape) != (c.draft_vocab_size, c.hidden_size):
            raise ModelError(f"{directory}: weight 'lm_head.weight' has shape {tuple(head.shape)}, expected {(c.draft_vocab_size, c.hidden_size)}")
        draft.lm_head = nn.Parameter(head, requires_grad=False)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ModelError(f"{directory}: checkpoint is missing weight(s) {', '.join(missing[:5])}")
    unexpected = sorted(set(tensors) - set(expected) - _IGNORED)
    if unexpected:
        raise ModelError(f"{directory}: unexpected weight(s) {', '.join(unexpected[:5])} for this config")
    for key, ref in expected.items():
        if tuple(tensors[key].shape) != tuple(ref.shape):
            raise ModelError(f"{directory}: weight {key!r} has shape {tuple(tensors[key].shape)}, expected {tuple(ref.shape)}")
    draft.load_state_dict({k: tensors[k].to(ref.dtype) for k, ref in expected.items()})


def read_draft_config(directory: str | os.PathLike) -> DraftConfig:
    """The :class:`DraftConfig` of a checkpoint directory, without reading its weights."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelError(f"{directory}: draft checkpoint directory not found")
    cfg_path = directory / "config.json"
    return config_from_speculators(read_json(cfg_path), cfg_path)


def read_verifier(directory: str | os.PathLike) -> str | None:
    """The verifier (target) a checkpoint names in ``speculators_config.verifier``, if any."""
    cfg = read_json(Path(directory) / "config.json")
    return ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")


def load_draft(directory: str | os.PathLike, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> DSparkDraft:
    """Read a speculators-format DSpark checkpoint directory (call ``bind_target`` next)."""
    directory = Path(directory)
    config = read_draft_config(directory)
    tensors = read_safetensors_dir(directory)
    for key in ("d2t", "t2d"):  # keep integer/bool mappings exact
        if key in tensors:
            tensors[key] = tensors[key].long() if key == "d2t" else tensors[key].bool()
    draft = DSparkDraft(config)
    _load_weights(draft, tensors, directory)
    return draft.to(device=device, dtype=dtype)


def save_draft(draft: DSparkDraft, directory: str | os.PathLike, *, verifier: str | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors``; the target's embedding/LM head are not saved."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items() if k != "lm_head"}
    if draft.lm_head is not None:
        tensors["lm_head.weight"] = draft.lm_head.detach().contiguous().cpu()
    save_file(tensors, str(directory / WEIGHTS_FILE))
    (directory / "config.json").write_text(json.dumps(config_to_speculators(draft.config, verifier), indent=2) + "\n", encoding="utf-8")
    return directory

"""Read a Hugging Face model directory: config.json, *.safetensors, tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dspark_core.errors import ModelError
from dspark_core.models.base import TargetConfig
from dspark_core.models.tokenizer import Tokenizer

# HF model_type values this loader understands.
SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object from ``path`` or raise a :class:`ModelError` naming the file."""
    if not path.is_file():
        raise ModelError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return data


def _need(cfg: dict[str, Any], key: str, path: Path) -> Any:
    if key not in cfg:
        raise ModelError(f"{path}: field {key!r} is missing")
    return cfg[key]


def hf_architecture(directory: str | Path) -> str:
    """The ``model_type`` of a Hugging Face checkpoint directory (lower case)."""
    path = Path(directory) / "config.json"
    return str(_need(read_json(path), "model_type", path)).lower()


def config_from_hf(cfg: dict[str, Any], path: Path) -> TargetConfig:
    """Translate a Hugging Face config dict into a :class:`TargetConfig`."""
    arch = str(_need(cfg, "model_type", path)).lower()
    if arch not in SUPPORTED:
        raise ModelError(f"{path}: model_type {arch!r} is not a Llama-family model ({', '.join(SUPPORTED)})")
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ModelError(f"{path}: rope_scaling {scaling!r} is not supported")
    d = int(_need(cfg, "hidden_size", path))
    heads = int(_need(cfg, "num_attention_heads", path))
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    try:
        return TargetConfig(
            architecture=arch,
            vocab_size=int(_need(cfg, "vocab_size", path)),
            hidden_size=d,
            intermediate_size=int(_need(cfg, "intermediate_size", path)),
            num_layers=int(_need(cfg, "num_hidden_layers", path)),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or d // heads),
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{path}: bad value in config ({exc})") from None


def read_safetensors_dir(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``directory`` (float32)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{directory}: no *.safetensors weight files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError) as exc:
            raise ModelError(f"{f}: cannot read safetensors ({exc})") from None
        tensors.update({k: v.float() for k, v in part.items()})
    return tensors


def read_hf_tokenizer(directory: Path, cfg: TargetConfig) -> Tokenizer:
    """tokenizer.json plus chat template and special ids from tokenizer_config.json."""
    from tokenizers import Tokenizer as HFTokenizer

    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ModelError(f"{path}: file not found")
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own exception type
        raise ModelError(f"{path}: cannot parse tokenizer ({exc})") from None
    tok_cfg_path = directory / "tokenizer_config.json"
    tok_cfg = read_json(tok_cfg_path) if tok_cfg_path.is_file() else {}
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return Tokenizer(backend, bos_token_id=cfg.bos_token_id, eos_token_ids=cfg.eos_token_ids, chat_template=template, add_bos=bool(tok_cfg.get("add_bos_token", False)))


def read_hf_dir(directory: str | Path) -> tuple[TargetConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, float32 weights and tokenizer of a Hugging Face checkpoint directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelError(f"{directory}: model directory not found")
    cfg_path = directory / "config.json"
    cfg = config_from_hf(read_json(cfg_path), cfg_path)
    return cfg, read_safetensors_dir(directory), read_hf_tokenizer(directory, cfg)

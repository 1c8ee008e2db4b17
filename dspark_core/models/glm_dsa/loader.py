"""Load a GLM-DSA target from a Hugging Face directory: ``config.json`` + ``*.safetensors`` (+ tokenizer).

Only the tensors the target uses are read, converted straight to the serving
dtype (no float32 copy of the whole checkpoint); extra layers past
``num_hidden_layers`` (GLM-5 ships a multi-token-prediction layer there) are
skipped. Quantised checkpoints (FP8 block scales) are refused with a clear
error rather than loaded wrongly.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from dspark_core.errors import ModelError
from dspark_core.models.glm_dsa.config import GlmDsaConfig, glm_dsa_config_from_hf
from dspark_core.models.glm_dsa.model import GlmDsaTarget
from dspark_core.models.hf_loader import read_hf_tokenizer, read_json

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
#: Tensors kept in float32 whatever the serving dtype (the router's expert-choice bias is tiny and precise).
FLOAT32_TENSORS = ("e_score_correction_bias",)


def wanted(name: str, cfg: GlmDsaConfig) -> bool:
    """Whether the target reads tensor ``name`` (layers beyond ``num_layers`` are not)."""
    m = _LAYER.match(name)
    return m is None or int(m.group(1)) < cfg.num_layers


def read_glm_dsa_tensors(directory: Path, cfg: GlmDsaConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors the target needs from every ``*.safetensors`` file, floating ones cast to ``dtype``
    (except :data:`FLOAT32_TENSORS`)."""
    from safetensors import SafetensorError, safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{directory}: no *.safetensors weight files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    if name.endswith("weight_scale_inv"):
                        raise ModelError(f"{f}: {name} is an FP8 block scale; quantised checkpoints are not supported")
                    if wanted(name, cfg):
                        t = handle.get_tensor(name)
                        if t.is_floating_point():
                            t = t.float() if name.endswith(FLOAT32_TENSORS) else t.to(dtype)
                        tensors[name] = t
        except (SafetensorError, OSError) as exc:
            raise ModelError(f"{f}: cannot read safetensors ({exc})") from None
    return tensors


def read_glm_dsa_dir(directory: str | os.PathLike, *, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> GlmDsaTarget:
    """A :class:`GlmDsaTarget` from a Hugging Face directory; ``model.tokenizer`` is set when
    ``tokenizer.json`` is present (else ``None``)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelError(f"{directory}: GLM-DSA checkpoints are Hugging Face directories (config.json + *.safetensors)")
    cfg_path = directory / "config.json"
    cfg = glm_dsa_config_from_hf(read_json(cfg_path), cfg_path)
    tensors = read_glm_dsa_tensors(directory, cfg, dtype)
    tokenizer = read_hf_tokenizer(directory, cfg) if (directory / "tokenizer.json").is_file() else None
    return GlmDsaTarget(cfg, tensors, dtype=dtype, device=device, tokenizer=tokenizer)

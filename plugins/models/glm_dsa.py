"""Model-family plugin: GLM-DSA targets (HF ``glm_moe_dsa``; also ``glm_dsa`` and DeepSeek-V3.2's ``deepseek_v32``).

This is the spec's "GLM DSA Python target": MLA with compressed latent KV, the
lightning indexer's top-k sparse attention and MoE feed-forward, written in
plain torch. It never imports torch_npu: on Ascend the NPU device plugin
provides the device and torch_npu runs these ops (``npu_kernel_backend=TORCH``).
"""

from __future__ import annotations

import os

import torch

from dspark_core.components import Component
from dspark_core.errors import ConfigError
from dspark_core.hookspecs import hookimpl
from dspark_core.models.glm_dsa import GLM_DSA_ARCHITECTURES, GlmDsaTarget, read_glm_dsa_dir

#: Architecture strings (HF model_type) this family serves.
ARCHITECTURES = frozenset(GLM_DSA_ARCHITECTURES)

#: Kernel backends the GLM-DSA target implements (``--npu_kernel_backend``).
KERNEL_BACKENDS = ("TORCH",)


class GlmDsaFamily:
    """Loads GLM-DSA checkpoints from Hugging Face safetensors directories."""

    name = "glm_dsa"
    architectures = ARCHITECTURES

    def load_target(self, path: str | os.PathLike, *, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, kernel_backend: str = "TORCH") -> GlmDsaTarget:
        """The target model; ``model.tokenizer`` is set when the directory has ``tokenizer.json``."""
        if kernel_backend.upper() not in KERNEL_BACKENDS:
            raise ConfigError(f"npu_kernel_backend={kernel_backend}: the GLM-DSA target implements only "
                              f"{', '.join(KERNEL_BACKENDS)} (plain torch ops)")
        return read_glm_dsa_dir(path, device=device, dtype=dtype)


@hookimpl
def dspark_components():
    return [Component("model_family", "glm_dsa",
                      "GLM-DSA targets (MLA + lightning-indexer top-k sparse attention + MoE) from HF safetensors")]


@hookimpl
def dspark_model_family(architecture: str):
    return GlmDsaFamily() if architecture.lower() in ARCHITECTURES else None

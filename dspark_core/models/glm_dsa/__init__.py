"""GLM-DSA target family: MLA + lightning-indexer sparse attention + MoE (HF ``glm_moe_dsa``).

Entry points: :class:`GlmDsaConfig` / :func:`glm_dsa_config_from_hf`,
:class:`GlmDsaTarget`, :func:`read_glm_dsa_dir` (HF safetensors loader),
:mod:`dspark_core.models.glm_dsa.tiny` (random test models) and
:mod:`dspark_core.models.glm_dsa.reference` (cache-free recompute for tests).
"""

from dspark_core.models.glm_dsa.cache import GlmDsaCache
from dspark_core.models.glm_dsa.config import GLM_DSA_ARCHITECTURES, GlmDsaConfig, glm_dsa_config_from_hf
from dspark_core.models.glm_dsa.loader import read_glm_dsa_dir
from dspark_core.models.glm_dsa.model import GlmDsaTarget

__all__ = ["GLM_DSA_ARCHITECTURES", "GlmDsaCache", "GlmDsaConfig", "GlmDsaTarget", "glm_dsa_config_from_hf",
           "read_glm_dsa_dir"]

"""YaRN RoPE scaling (YaRN arXiv:2309.00071): the inverse frequencies and the attention factor.

Same formulas as transformers 5's `_compute_yarn_parameters` (modeling_rope_utils.py), which
Qwen2/Qwen3 checkpoints use past their pre-training length (Qwen3's model card:
`{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}`):

- frequencies: each dimension pair i (wavelength 2π/θ_i) is interpolated (θ_i / factor) or
  extrapolated (θ_i kept) by how many rotations it makes over the original context L: pairs
  turning more than `beta_fast` (32) times are kept, fewer than `beta_slow` (1) times are
  interpolated, a linear ramp over the dimension index in between ("NTK-by-parts");
- attention: cos and sin are multiplied by `attention_factor`, by default
  0.1·ln(factor) + 1 (the paper's √(1/t)), which scales every q·k logit by its square.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: Mapping[str, Any]) -> float:
    """The factor cos/sin are multiplied by: `attention_factor` when given, else from `factor`
    (and DeepSeek's `mscale` / `mscale_all_dim` when both are set)."""
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _mscale(factor, float(mscale)) / _mscale(factor, float(mscale_all_dim))
    return _mscale(factor)


def _correction_dim(rotations: float, dim: int, base: float, length: float) -> float:
    """The dimension index whose pair makes `rotations` turns over `length` positions."""
    return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, scaling: Mapping[str, Any]) -> np.ndarray:
    """Inverse frequencies [dim/2] (float32) of YaRN's "NTK-by-parts" interpolation."""
    factor = float(scaling["factor"])
    length = float(scaling["original_max_position_embeddings"])
    beta_fast = scaling.get("beta_fast") or 32  # `or`: transformers treats 0/None as unset
    beta_slow = scaling.get("beta_slow") or 1
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolated = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolated = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    low = _correction_dim(beta_fast, dim, base, length)
    high = _correction_dim(beta_slow, dim, base, length)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (high frequency), 0: interpolate
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32)

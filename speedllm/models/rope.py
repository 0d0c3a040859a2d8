"""RoPE frequencies: default, and the scaled variants transformers' Qwen3 accepts (linear, dynamic NTK, YaRN).

`rope_scaling` is the model config's dict (transformers' `rope_parameters` without `rope_theta`), or None for
plain RoPE. `inverse_frequencies` gives the per-pair frequencies and the factor cos/sin are multiplied by
(YaRN's attention scaling, 1 otherwise). Dynamic NTK depends on the longest position of the forward; the
others are fixed by the config.
"""

import math
from typing import Optional, Tuple

import torch

from speedllm.errors import UserError

ROPE_TYPES = ("linear", "dynamic", "yarn")


def rope_scaling_from_hf(config: dict) -> Optional[dict]:
    """Our `rope_scaling` from an HF config.json (transformers 5 `rope_parameters`, 4.x `rope_scaling`)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    rope.pop("rope_theta", None)
    if kind == "default":
        return None
    if kind == "yarn":  # transformers' default when the file leaves it out
        rope.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    scaling = {"rope_type": kind, **rope}
    check_rope_scaling(scaling, "config.json rope_parameters")
    return scaling


def check_rope_scaling(scaling, key: str) -> None:
    """One-line error naming `key` when `scaling` is not a RoPE scaling we implement."""
    kind = scaling.get("rope_type")
    if kind not in ROPE_TYPES:
        raise UserError(f"{key}: rope_type {kind!r} is not supported; use one of {', '.join(ROPE_TYPES)} "
                        "(or no scaling)")
    needed = ["factor"] + (["original_max_position_embeddings"] if kind == "yarn" else [])
    missing = [name for name in needed if scaling.get(name) is None]
    if missing:
        raise UserError(f"{key}: rope_type {kind} needs {', '.join(missing)}; add it")


def _default(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(theta: float, dim: int, scaling: dict) -> Tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): interpolate the slow pairs by `factor`, keep the fast ones, ramp in between."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(num_rotations):  # the pair index that turns `num_rotations` times over `original` tokens
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp  # 1: keep the pair's native frequency, 0: divide it by factor
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def max_positions(cfg) -> int:
    """The longest sequence the model runs: max_position_embeddings, times the factor under dynamic NTK, whose
    frequencies exist to go past it (linear and YaRN fold their extension into max_position_embeddings)."""
    scaling = cfg.rope_scaling
    if scaling and scaling["rope_type"] == "dynamic":
        return int(cfg.max_position_embeddings * scaling["factor"])
    return cfg.max_position_embeddings


def inverse_frequencies(cfg, seq_len: Optional[int] = None) -> Tuple[torch.Tensor, float]:
    """(inv_freq [rotary dims / 2] fp32 on the CPU, cos/sin scale) for `cfg` (a ModelConfig); the rotary dims are
    head_dim * partial_rotary_factor, as transformers rounds them.

    Args:
        seq_len: longest position + 1 of this forward; only dynamic NTK uses it (None: the native length).
    """
    with torch.device("cpu"):  # also when the model is built on the meta device
        return _frequencies(cfg.rope_theta, int(cfg.head_dim * cfg.partial_rotary_factor), cfg.rope_scaling,
                            cfg.max_position_embeddings, seq_len)


def _frequencies(theta, dim, scaling, native, seq_len):
    kind = scaling["rope_type"] if scaling else "default"
    if kind == "default":
        return _default(theta, dim), 1.0
    if kind == "linear":
        return _default(theta, dim) / scaling["factor"], 1.0
    if kind == "dynamic":
        # NTK-aware: beyond max_position_embeddings the base grows with the sequence length
        factor = scaling["factor"]
        seq_len = max(seq_len or native, native)
        base = theta * ((factor * seq_len / native) - (factor - 1)) ** (dim / (dim - 2))
        return _default(base, dim), 1.0
    return _yarn(theta, dim, scaling)

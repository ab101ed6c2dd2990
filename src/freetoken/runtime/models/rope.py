"""Rotary position embedding: inverse frequencies per rope type, and their application."""

from __future__ import annotations

import math

import torch

from freetoken.runtime.config import RopeConfig


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    original = rope.original_max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attention_factor)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [head_dim // 2] float32, scaling applied to cos and sin)."""
    if rope.type == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    return inv_freq, 1.0


class RotaryEmbedding:
    """cos/sin tables for given positions; holds no parameters, so it survives meta-device construction."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        with torch.device("cpu"):  # real numbers even when the model is built on the meta device
            self.inv_freq, self.scaling = rope_inv_freq(rope, head_dim)
        self._on: dict[torch.device, torch.Tensor] = {}

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, D] in `dtype`."""
        inv_freq = self._on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, T, D] (heads first), cos/sin [T, D]."""
    return x * cos + rotate_half(x) * sin


def partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope on the first cos.shape[-1] dims of x [N, T, D]; the rest passes through."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat([apply_rotary(x[..., :d], cos, sin), x[..., d:]], dim=-1)

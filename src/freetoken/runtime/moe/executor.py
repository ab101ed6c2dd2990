"""The `--moe-backend` axis: how routed experts are computed. One registry, lazy factories."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch

from freetoken.errors import FreeTokenError
from freetoken.runtime.moe.pool import HostExpertPool

# name -> "module:Class"; adding a backend is one file and one line here.
MOE_BACKENDS: dict[str, str] = {
    "fused": "freetoken.runtime.moe.fused:FusedExecutor",
    "cpu": "freetoken.runtime.moe.cpu:CpuExecutor",
}
BACKEND_CHOICES = ("auto", *MOE_BACKENDS)


class ExpertExecutor(ABC):
    """Computes one MoE layer's routed experts for a batch of tokens."""

    name: str

    def __init__(self, pool: HostExpertPool, device: torch.device) -> None:
        self.pool = pool
        self.device = device

    @abstractmethod
    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] on the compute device, topk_ids/topk_weights [T, K] -> [T, H] on the compute device."""


def resolve_backend(name: str, device: torch.device) -> str:
    """`auto` picks what this issue's runtime has: experts beside the compute, on the compute device."""
    if name == "auto":
        return "fused"
    if name not in MOE_BACKENDS:
        raise FreeTokenError(f"unknown MoE backend {name!r}; choose one of: {', '.join(BACKEND_CHOICES)}")
    return name


def build_executor(name: str, pool: HostExpertPool, device: torch.device) -> ExpertExecutor:
    module_name, _, class_name = MOE_BACKENDS[resolve_backend(name, device)].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(pool, device)

"""The `--moe-backend` axis: how routed experts are computed. One registry, lazy factories."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from freetoken.errors import FreeTokenError
from freetoken.runtime.config import MoeConfig
from freetoken.runtime.moe.counters import MoeCounters
from freetoken.runtime.moe.expert_fn import PairBias, down_bias_sum
from freetoken.runtime.moe.pool import HostExpertPool

# name -> "module:Class"; adding a backend is one file and one line here.
MOE_BACKENDS: dict[str, str] = {
    "fused": "freetoken.runtime.moe.fused:FusedExecutor",
    "offload": "freetoken.runtime.moe.cached:OffloadExecutor",
    "cpu": "freetoken.runtime.moe.cached:CpuMissExecutor",
    "hybrid": "freetoken.runtime.moe.cached:HybridExecutor",
}
BACKEND_CHOICES = ("auto", *MOE_BACKENDS)
CACHED_BACKENDS = ("offload", "cpu", "hybrid")


@dataclass
class ExecutorContext:
    """Everything an executor is built from; made once by the engine."""

    pool: HostExpertPool
    device: torch.device
    moe: MoeConfig
    num_slots: int
    num_experts_per_tok: int
    cpu_layers: frozenset[int]
    counters: MoeCounters


class ExpertExecutor(ABC):
    """Computes one MoE layer's routed experts for a batch of tokens."""

    name: str

    def __init__(self, ctx: ExecutorContext) -> None:
        self.ctx = ctx
        self.pool = ctx.pool
        self.device = ctx.device
        self.counters = ctx.counters
        self.fn = ctx.pool.fn
        # experts' biases (a few KB per expert) stay on the compute device whole: never cached or evicted
        self.gate_up_bias = {layer: t.to(ctx.device) for layer, t in ctx.pool.gate_up_bias.items()}
        self.down_bias = {layer: t.to(ctx.device) for layer, t in ctx.pool.down_bias.items()}

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] on the compute device, topk_ids/topk_weights [T, K] -> [T, H] on the compute device:
        the routed experts, then their down biases (once per pair, whichever branch computed it)."""
        out = self.compute(layer, x, topk_ids, topk_weights)
        if layer not in self.down_bias:
            return out
        ids = topk_ids.to(x.device)
        return (out.float() + down_bias_sum(self.down_bias[layer], ids, topk_weights)).to(out.dtype)

    def host_threads(self) -> int:
        """Threads a decode step may keep busy on the host's cores computing experts (0: none)."""
        return 0

    def pair_bias(self, layer: int, topk_ids: torch.Tensor) -> PairBias | None:
        """The gate/up biases of `topk_ids`' experts (expert ids), for a layer whose experts have them."""
        bias = self.gate_up_bias.get(layer)
        return None if bias is None else PairBias(bias, topk_ids)

    @abstractmethod
    def compute(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts without their down biases: as `forward`."""

    def begin_pass(self, tokens: int, rows: int) -> None:  # noqa: B027 - only cached executors act
        """Before a forward pass of `tokens` new tokens per sequence, `rows` token rows in all."""

    def end_pass(self) -> None:  # noqa: B027
        """After the forward pass (also when it raised)."""

    def graph_blocker(self, rows: int) -> str | None:
        """Why a decode step of `rows` rows cannot be captured in a CUDA graph; None: it can (every
        expert's work stays on the device, with no host read-back)."""
        return self.stored_blocker()

    def stored_blocker(self) -> str | None:
        """Experts kept as stored blocks stay on the device only through the Triton decode kernel."""
        from freetoken.runtime.moe.experts import decode_kernel_on

        if self.pool.stored and self.device.type == "cuda" and not decode_kernel_on():
            return "experts kept as stored blocks need the Triton decode kernel (it is off)"
        return None

    def resize_slots(self, num_slots: int) -> None:
        """At a safe point: hold `num_slots` expert slots on the device (executors with slots)."""
        raise FreeTokenError(f"the {self.name} backend has no expert slots to resize")

    def set_cpu_threads(self, threads: int) -> None:  # noqa: B027 - only executors with a CPU branch
        """At a safe point: the CPU may use `threads` threads now."""

    def host_banks(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
        """layer -> (gate_up, down) banks when every expert of every layer is computed on the host from
        them (a whole CPU decode step may then run natively); None otherwise."""
        return None

    def cpu_threads(self) -> int:
        """Threads the CPU expert compute may use now."""
        return torch.get_num_threads()

    def count_host_steps(self, distinct: np.ndarray) -> None:  # noqa: B027 - only executors with host_banks
        """Count a step that ran outside `forward`: distinct [L] experts each MoE layer (in order) used."""

    def probe(self) -> None:  # noqa: B027 - only executors that split misses use bandwidths
        """Re-measure B_P and B_H cheaply (one expert each) and fold them into the running estimates."""

    def close(self) -> None:  # noqa: B027 - most executors own no threads
        """Release worker threads; the executor is not used afterwards."""


def resolve_backend(
    moe: MoeConfig, device: torch.device, has_moe_layers: bool, recommended: str | None = None
) -> str:
    """`auto`: no MoE layers -> fused; no CUDA -> cpu; else this machine's measured recommendation
    (`bench bw`), else offload, or hybrid when the bandwidths given say the CPU can take part."""
    name = moe.backend
    if name not in BACKEND_CHOICES:
        raise FreeTokenError(f"unknown MoE backend {name!r}; choose one of: {', '.join(BACKEND_CHOICES)}")
    if name != "auto":
        return name
    if not has_moe_layers:
        return "fused"
    if device.type != "cuda":
        return "cpu"
    if recommended in CACHED_BACKENDS:
        return recommended
    if moe.pcie_gbps and moe.host_gbps and moe.host_gbps > moe.pcie_gbps:
        return "hybrid"
    return "offload"


def build_executor(name: str, ctx: ExecutorContext) -> ExpertExecutor:
    module_name, _, class_name = MOE_BACKENDS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(ctx)

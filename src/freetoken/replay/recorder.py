"""Recording the router's choices while the engine runs (`--record-routing FILE`).

The MoE blocks hand each layer's top-k ids to the recorder; the engine closes a forward pass with
`end_pass`, which stacks the layers into rows. Who drives the engine (its own loop, the server's
batcher) says first which requests the rows belong to and whether it is prefill or decode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from freetoken.replay.trace import PREFILL, RoutingTrace


class RoutingRecorder:
    def __init__(self, moe_layers: tuple[int, ...], num_experts: int, top_k: int, model: str) -> None:
        self.moe_layers = moe_layers
        self.meta = {
            "model": model,
            "moe_layers": list(moe_layers),
            "num_experts": num_experts,
            "top_k": top_k,
        }
        self._index = {layer: i for i, layer in enumerate(moe_layers)}
        self._pending: dict[int, np.ndarray] = {}  # MoE layer index -> [T, K] of the pass in flight
        self._phase, self._requests = PREFILL, [0]
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.passes = 0

    def context(self, phase: int, requests: list[int]) -> None:
        """The next passes' rows: `requests` one per row, or one for all rows of a pass."""
        self._phase, self._requests = phase, list(requests)

    def add(self, layer: int, ids: torch.Tensor) -> None:
        self._pending[self._index[layer]] = ids.detach().to("cpu", torch.int16).numpy()

    def end_pass(self, rows: int) -> None:
        if len(self._pending) != len(self.moe_layers):
            self._pending.clear()  # a pass that did not reach every layer (it raised): not recorded
            return
        experts = np.stack([self._pending[i] for i in range(len(self.moe_layers))], axis=1)  # [T, L, K]
        self._pending.clear()
        requests = self._requests if len(self._requests) == rows else self._requests[:1] * rows
        self._chunks.append(
            (
                experts,
                np.full(rows, self._phase, dtype=np.uint8),
                np.asarray(requests, dtype=np.int32),
                np.full(rows, self.passes, dtype=np.int32),
            )
        )
        self.passes += 1

    def trace(self) -> RoutingTrace:
        k = int(self.meta["top_k"])
        if not self._chunks:
            empty = np.zeros(0, dtype=np.int32)
            return RoutingTrace(
                np.zeros((0, len(self.moe_layers), k), np.int64),
                empty.astype(np.uint8),
                empty,
                empty,
                self.meta,
            )
        parts = list(zip(*self._chunks, strict=True))
        return RoutingTrace(*(np.concatenate(p) for p in parts), meta=self.meta)  # type: ignore[call-arg]

    def save(self, path: Path | str) -> Path:
        return self.trace().save(Path(path))


def attach_recorder(engine: Any) -> RoutingRecorder:
    """Start recording `engine`'s routing (an Engine; typed loosely to keep this module engine-free)."""
    cfg = engine.config
    recorder = RoutingRecorder(
        tuple(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_tok, engine.engine_config.model_path.name
    )
    engine.record_routing(recorder)
    return recorder

"""Routing traces: which experts each token chose in each MoE layer, in the order the engine ran.

File format (numpy .npz, written atomically):
  experts  [N, L, K] int16   expert ids of token row n at MoE layer index l (the model's MoE layers in order)
  phase    [N] uint8         0 = prefill, 1 = decode
  request  [N] int32         request id of the row
  pass_id  [N] int32         forward pass of the row: rows of one pass ran through each layer together
  meta     0-d str           JSON: format, version, model, moe_layers, num_experts, top_k
Rows are in execution order; a batched decode pass holds one row per running request.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from freetoken.errors import FreeTokenError
from freetoken.runtime.sequence import DECODE, PREFILL  # noqa: F401 - a trace's phases, re-exported

FORMAT, VERSION = "freetoken-routing-trace", 1


@dataclass(frozen=True)
class Group:
    """One layer step of one pass: the distinct experts the pass's rows chose there."""

    pass_id: int
    layer: int  # MoE layer index (0 .. L-1), not the model's layer id
    phase: int
    experts: np.ndarray  # [M] distinct ids, ascending


@dataclass(frozen=True)
class RoutingTrace:
    experts: np.ndarray  # [N, L, K]
    phase: np.ndarray  # [N]
    request: np.ndarray  # [N]
    pass_id: np.ndarray  # [N]
    meta: dict[str, Any]

    @property
    def num_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    def __len__(self) -> int:
        return int(self.experts.shape[0])

    def groups(self) -> Iterator[Group]:
        """Layer steps in execution order: pass by pass, and within a pass layer by layer."""
        if not len(self):
            return
        bounds = np.flatnonzero(np.diff(self.pass_id)) + 1
        for rows in np.split(np.arange(len(self)), bounds):
            pid, phase = int(self.pass_id[rows[0]]), int(self.phase[rows[0]])
            for layer in range(self.num_layers):
                yield Group(pid, layer, phase, np.unique(self.experts[rows, layer]))

    def save(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".npz")
        os.close(fd)
        try:
            np.savez_compressed(
                tmp,
                experts=self.experts.astype(np.int16),
                phase=self.phase.astype(np.uint8),
                request=self.request.astype(np.int32),
                pass_id=self.pass_id.astype(np.int32),
                meta=np.array(json.dumps({"format": FORMAT, "version": VERSION, **self.meta})),
            )
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path


def load_trace(path: Path | str) -> RoutingTrace:
    """Read and check a trace; any problem is one FreeTokenError naming the file and what is wrong."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in ("experts", "phase", "request", "pass_id", "meta")}
    except FileNotFoundError:
        raise FreeTokenError(f"{path}: no such trace") from None
    except KeyError as exc:
        raise FreeTokenError(f"{path}: not a routing trace (no {exc.args[0]!r} array)") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise FreeTokenError(f"{path}: unreadable or truncated trace ({exc})") from None
    try:
        meta = json.loads(str(arrays.pop("meta")))
    except json.JSONDecodeError:
        raise FreeTokenError(f"{path}: the trace's metadata is not JSON") from None
    if meta.get("format") != FORMAT:
        raise FreeTokenError(f"{path}: not a routing trace (format {meta.get('format')!r})")
    experts = arrays["experts"]
    n = experts.shape[0] if experts.ndim == 3 else -1
    if n < 0 or any(arrays[k].shape != (n,) for k in ("phase", "request", "pass_id")):
        raise FreeTokenError(f"{path}: arrays of inconsistent shapes (experts {list(experts.shape)})")
    listed = len(meta.get("moe_layers", []))
    if experts.shape[1] != listed:
        raise FreeTokenError(f"{path}: {experts.shape[1]} layers of routing but the metadata lists {listed}")
    if n and (experts.min() < 0 or experts.max() >= int(meta["num_experts"])):
        raise FreeTokenError(f"{path}: expert ids outside [0, {meta['num_experts']})")
    return RoutingTrace(experts.astype(np.int64), arrays["phase"], arrays["request"], arrays["pass_id"], meta)


def check_matches(trace: RoutingTrace, moe_layers: int, num_experts: int, source: str) -> None:
    """One-line error when a trace was recorded on a model of another shape."""
    if trace.num_layers != moe_layers or trace.num_experts != num_experts:
        raise FreeTokenError(
            f"{source}: trace has {trace.num_layers} MoE layers of {trace.num_experts} experts, "
            f"the model {moe_layers} of {num_experts}"
        )

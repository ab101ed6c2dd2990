"""Load an FTW folder: dense tensors into the model, expert banks straight into the pool's buffers.

No tensor discovery or repacking: the manifest lists every tensor in its final layout.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from freetoken.errors import FreeTokenError
from freetoken.formats.ftw_reader import FtwCheckpoint
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.moe.pool import HostExpertPool

ProgressFn = Callable[[int, int], None]


def _into(ftw: FtwCheckpoint, entry, dest: torch.Tensor) -> None:
    """Read straight into `dest` when layouts agree, else through a host buffer (dtype or device differ)."""
    if dest.device.type == "cpu" and dest.dtype == entry.torch_dtype and dest.is_contiguous():
        ftw.read_into(entry, dest)
    else:
        dest.copy_(ftw.read(entry))


def ftw_weights(folder: Path, verify: bool = False) -> Callable[..., HostExpertPool]:
    def load(model: nn.Module, cfg: ModelConfig, dtype: torch.dtype, progress: ProgressFn | None = None):
        ftw = FtwCheckpoint(folder)
        if verify:
            bad = ftw.verify()
            if bad:
                shown = ", ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
                raise FreeTokenError(f"{folder}: checksum mismatch in {shown}")
        params = dict(model.named_parameters())
        dense = {e.name: e for e in ftw.entries if e.kind == "dense"}
        missing = [n for n in params if n not in dense]
        unexpected = [n for n in dense if n not in params]
        if missing or unexpected:
            raise FreeTokenError(
                f"{folder}: manifest does not match the model (missing {missing[:3]}, "
                f"unexpected {unexpected[:3]})"
            )
        banks = {(e.layer, e.kind): e for e in ftw.entries if e.kind in ("gate_up", "down")}
        absent = [
            (layer, kind)
            for layer in cfg.moe_layers
            for kind in ("gate_up", "down")
            if (layer, kind) not in banks
        ]
        if absent:
            raise FreeTokenError(f"{folder}: manifest lacks expert banks {absent[:4]}")
        pool = HostExpertPool.allocate(
            cfg.moe_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype
        )
        total, done = ftw.nbytes, 0
        with torch.no_grad():
            for name, entry in dense.items():
                if tuple(params[name].shape) != entry.shape:
                    raise FreeTokenError(
                        f"{folder}: tensor {name} has shape {list(entry.shape)}, expected "
                        f"{list(params[name].shape)}"
                    )
                _into(ftw, entry, params[name].data)
                done += entry.nbytes
                if progress is not None:
                    progress(done, total)
            for layer in cfg.moe_layers:
                for kind, dest in (("gate_up", pool.gate_up[layer]), ("down", pool.down[layer])):
                    entry = banks[(layer, kind)]
                    if entry.shape != tuple(dest.shape):
                        raise FreeTokenError(
                            f"{folder}: bank {entry.name} has shape {list(entry.shape)}, "
                            f"expected {list(dest.shape)}"
                        )
                    _into(ftw, entry, dest)
                    done += entry.nbytes
                    if progress is not None:
                        progress(done, total)
        pool.mark_filled()
        return pool

    return load

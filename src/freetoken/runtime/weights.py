"""Stream a checkpoint into a built model: dense tensors into its parameters, experts into the host pool."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from freetoken.errors import FreeTokenError
from freetoken.formats.safetensors_dir import SafetensorsCheckpoint
from freetoken.formats.tensor_names import ExpertNaming
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.moe.pool import HostExpertPool

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes total)


def _listing(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def load_weights(
    model: nn.Module,
    cfg: ModelConfig,
    ckpt: SafetensorsCheckpoint,
    naming: ExpertNaming,
    dtype: torch.dtype,
    progress: ProgressFn | None = None,
) -> HostExpertPool:
    """Fill `model`'s parameters (already materialised on their device) and return the filled pool.

    Every name and shape is checked against the checkpoint headers before any tensor is read.
    """
    where = ckpt.model_dir
    params = dict(model.named_parameters())  # tied weights appear once
    pool = HostExpertPool.allocate(
        cfg.moe_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype
    )
    plan: list[tuple[str, object]] = []
    unexpected: list[str] = []
    for name in ckpt.names():
        target = naming.classify(name)
        if target is not None:
            if target.layer not in pool.gate_up:
                unexpected.append(name)
                continue
            expected = pool.expected_shape(target)
        elif name in params:
            expected = tuple(params[name].shape)
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some tied checkpoints still store the head: it is the embedding
        else:
            unexpected.append(name)
            continue
        if ckpt.shape(name) != expected:
            raise FreeTokenError(
                f"{where}: tensor {name} has shape {list(ckpt.shape(name))}, expected {list(expected)}"
            )
        plan.append((name, target if target is not None else params[name]))
    if unexpected:
        raise FreeTokenError(f"{where}: unexpected tensors: {_listing(unexpected)}")
    planned = {name for name, _ in plan}
    missing = [name for name in params if name not in planned]
    if missing:
        raise FreeTokenError(f"{where}: missing tensors: {_listing(missing)}")

    total = sum(ckpt.nbytes(name) for name, _ in plan)
    done = 0
    with torch.no_grad():
        for name, dest in plan:
            tensor = ckpt.read(name)
            if isinstance(dest, torch.Tensor):
                dest.copy_(tensor)
            else:
                pool.write(dest, name, tensor)
            del tensor
            done += ckpt.nbytes(name)
            if progress is not None:
                progress(done, total)
    absent = pool.missing()
    if absent:
        raise FreeTokenError(f"{where}: missing expert tensors: {_listing(absent)}")
    return pool

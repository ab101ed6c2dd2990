"""Stream a checkpoint into a built model: dense tensors into its parameters, experts into the host pool."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from freetoken.codecs import CODECS, Codec
from freetoken.errors import FreeTokenError
from freetoken.formats.gguf_checkpoint import GgufCheckpoint
from freetoken.formats.safetensors_dir import SafetensorsCheckpoint
from freetoken.formats.tensor_names import BIAS_PARTS, ExpertNaming, ExpertTensor
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.moe.expert_fn import expert_fn_of
from freetoken.runtime.moe.pool import HostExpertPool, expert_tensor_shape

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes total)


def _listing(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


@dataclass
class CheckpointPlan:
    """Where every checkpoint tensor goes, checked against the headers before anything is read."""

    dense: list[tuple[str, torch.Tensor]]  # (checkpoint name, the parameter it fills)
    experts: dict[int, list[tuple[str, ExpertTensor]]]  # layer -> (checkpoint name, pool target)


def plan_checkpoint(
    model: nn.Module, cfg: ModelConfig, ckpt: SafetensorsCheckpoint, naming: ExpertNaming
) -> CheckpointPlan:
    where = ckpt.model_dir
    params = dict(model.named_parameters())  # tied weights appear once
    moe_layers = set(cfg.moe_layers)
    plan = CheckpointPlan([], {layer: [] for layer in cfg.moe_layers})
    unexpected: list[str] = []
    for name in ckpt.names():
        canon = naming.canonical(name)  # the plan keeps the checkpoint's name for reading
        if canon is None or multi_token_block(canon, cfg):
            continue
        target = naming.classify(canon)
        if target is not None:
            if target.layer not in moe_layers:
                unexpected.append(name)
                continue
            expected = expert_tensor_shape(
                target, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
            )
        elif canon in params:
            expected = tuple(params[canon].shape)
        elif canon == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some tied checkpoints still store the head: it is the embedding
        else:
            unexpected.append(name)
            continue
        if ckpt.shape(name) != expected:
            raise FreeTokenError(
                f"{where}: tensor {name} has shape {list(ckpt.shape(name))}, expected {list(expected)}"
            )
        if target is not None:
            plan.experts[target.layer].append((name, target))
        else:
            plan.dense.append((name, params[canon]))
    if unexpected:
        raise FreeTokenError(f"{where}: unexpected tensors: {_listing(unexpected)}")
    planned = {id(param) for _, param in plan.dense}
    missing = [name for name, param in params.items() if id(param) not in planned]
    if missing:
        raise FreeTokenError(f"{where}: missing tensors: {_listing(missing)}")
    return plan


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
log = logging.getLogger("freetoken.loading")


def multi_token_block(name: str, cfg: ModelConfig) -> bool:
    """Whether `name` is in a multi-token-prediction block published checkpoints append after the trunk
    (`num_nextn_predict_layers` layers from `num_hidden_layers` on: DeepSeek-V3's, GLM-4.5's): not read."""
    extra = cfg.raw.get("num_nextn_predict_layers")
    match = _LAYER.match(name)
    return (
        isinstance(extra, int) and extra > 0 and match is not None and int(match.group(1)) >= cfg.num_layers
    )


def stored_codecs(ckpt: object, plan: CheckpointPlan, keep: frozenset[str]) -> dict[int, tuple[Codec, Codec]]:
    """Layers whose experts stay in the blocks the file stores them in: every tensor of a part (whole-layer
    banks as GGUF's, or expert by expert as an FP8 safetensors checkpoint's) in one codec, gate and up in
    the same, both codecs in `keep` (what the expert kernel computes from), at least one of them blocks
    (float experts take the pool dtype). Other layers are dequantised to the pool dtype."""
    codec_of = getattr(ckpt, "codec", None)
    if not keep or codec_of is None:
        return {}
    out: dict[int, tuple[Codec, Codec]] = {}
    for layer, items in plan.experts.items():
        found: dict[str, set[Codec]] = {}
        try:
            for name, target in items:
                if target.part in BIAS_PARTS:  # fp32 beside the banks whatever the file stores
                    continue
                codec = codec_of(name)
                for part in ("gate", "up") if target.part == "gate_up" else (target.part,):
                    found.setdefault(part, set()).add(codec)
        except FreeTokenError:  # a type no codec has: dequantised by the gguf package, if it can
            continue
        if set(found) != {"gate", "up", "down"} or any(len(codecs) != 1 for codecs in found.values()):
            continue
        gate, up, down = (next(iter(found[part])) for part in ("gate", "up", "down"))
        floats = gate.block_elements == down.block_elements == 1
        if gate == up and {gate.name, down.name} <= keep and not floats:
            out[layer] = (gate, down)
    return out


def widening_reasons(
    ckpt: object, plan: CheckpointPlan, keep: frozenset[str], stored: dict[int, tuple[Codec, Codec]]
) -> dict[int, str]:
    """Why each layer whose experts the file stores in blocks is not kept so (`stored`: the layers that
    are) and is dequantised at load instead: layer -> one line."""
    type_name = getattr(ckpt, "type_name", None)
    if type_name is None:
        return {}
    out: dict[int, str] = {}
    for layer, items in plan.experts.items():
        parts = {target.part: type_name(name) for name, target in items if target.part not in BIAS_PARTS}
        types = sorted(set(parts.values()))
        if layer in stored or all(t in ("F32", "F16", "BF16") for t in types):
            continue
        unread = [t for t in types if t not in CODECS]
        if unread:
            why = f"no codec reads {', '.join(unread)} (the gguf package dequantises it)"
        elif not keep:
            why = "this backend on this device keeps no expert type as stored"
        elif not set(types) <= keep:
            why = f"{', '.join(t for t in types if t not in keep)} is not read as stored here"
        elif parts.get("gate", parts.get("gate_up")) != parts.get("up", parts.get("gate_up")):
            why = "its gate and up projections are stored in different types"
        else:
            why = "slots hold one form for every layer, and another layer's experts cannot stay as stored"
        out[layer] = f"layer {layer}: experts ({'/'.join(types)}) widened at load: {why}"
    return out


def in_every_layer(
    stored: dict[int, tuple[Codec, Codec]], layers: tuple[int, ...]
) -> dict[int, tuple[Codec, Codec]]:
    """`stored` when every layer keeps its experts as stored (device slots hold codec blocks for every
    layer, or values for every layer), else none."""
    return stored if set(stored) == set(layers) else {}


def fill_experts(
    pool: HostExpertPool, ckpt: SafetensorsCheckpoint, items: list[tuple[str, ExpertTensor]]
) -> int:
    """Copy expert tensors into the pool's banks (as stored for the pool's `stored` layers); returns the
    checkpoint bytes read. A GGUF tensor that needs no conversion is read from the file straight into its
    place (parallel reads, no mapping of the file); the others are read, converted, then copied."""
    read = 0
    for name, target in items:
        as_stored = target.layer in pool.stored and target.part not in BIAS_PARTS
        form = ckpt.plain_form(name, as_stored) if isinstance(ckpt, GgufCheckpoint) else None
        dest = pool.plain_destination(target, name, *form) if form is not None else None
        if dest is not None:
            ckpt.read_into(name, dest)  # type: ignore[attr-defined]
            pool.mark_written(target)
        else:
            tensor = ckpt.read_stored(name) if as_stored else ckpt.read(name)  # type: ignore[attr-defined]
            pool.write(target, name, tensor)
            del tensor
        read += ckpt.nbytes(name)
    return read


def check_filled(pool: HostExpertPool, where: object) -> None:
    absent = pool.missing()
    if absent:
        raise FreeTokenError(f"{where}: missing expert tensors: {_listing(absent)}")


def load_weights(
    model: nn.Module,
    cfg: ModelConfig,
    ckpt: SafetensorsCheckpoint,
    naming: ExpertNaming,
    dtype: torch.dtype,
    progress: ProgressFn | None = None,
    keep_stored: frozenset[str] = frozenset(),
    all_stored: bool = False,
) -> HostExpertPool:
    """Fill `model`'s parameters (already materialised on their device) and return the filled pool.
    `keep_stored`: codecs whose expert blocks the pool may keep as the file stores them (stored_codecs);
    `all_stored`: only if every layer keeps its experts as stored (for expert slots)."""
    plan = plan_checkpoint(model, cfg, ckpt, naming)
    stored = stored_codecs(ckpt, plan, keep_stored)
    if all_stored:
        stored = in_every_layer(stored, cfg.moe_layers)
    for line in widening_reasons(ckpt, plan, keep_stored, stored).values():
        log.info(line)
    pool = HostExpertPool.allocate(
        cfg.moe_layers,
        cfg.num_experts,
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        dtype,
        stored=stored,
        fn=expert_fn_of(cfg),
        biased=cfg.expert_bias,
    )
    names = [name for name, _ in plan.dense] + [name for items in plan.experts.values() for name, _ in items]
    total, done = sum(ckpt.nbytes(name) for name in names), 0
    with torch.no_grad():
        for name, param in plan.dense:
            param.copy_(ckpt.read(name))
            done += ckpt.nbytes(name)
            if progress is not None:
                progress(done, total)
        for items in plan.experts.values():
            done += fill_experts(pool, ckpt, items)
            if progress is not None:
                progress(done, total)
    check_filled(pool, ckpt.model_dir)
    return pool

"""Load an FTW folder: dense tensors into the model, expert banks straight into the pool's buffers.

No tensor discovery or repacking: the manifest lists every tensor in its final layout, and the manifest
and every shard's size are always checked. With `verify`, each tensor's crc32 is computed from the bytes
as they land, on worker threads beside the reads (zlib releases the interpreter lock), so a corrupt file
fails the load instead of producing NaN. By default (`verify` None) that happens where the cores allow
it to cost little: on 2 cores it added ~40% to a 3.5 GB load from the page cache, as the checksum
threads take the cores the reads use.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from freetoken.codecs import get_codec
from freetoken.errors import FreeTokenError
from freetoken.formats.ftw import TensorEntry
from freetoken.formats.ftw_reader import FtwCheckpoint
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.loading.weights import in_every_layer
from freetoken.runtime.measure.cpu_share import allowed_cores
from freetoken.runtime.moe.expert_fn import expert_fn_of
from freetoken.runtime.moe.pool import HostExpertPool

ProgressFn = Callable[[int, int], None]


CHECKSUM_THREADS = 2  # crc32 runs at ~3.7 GB/s a thread: two keep up with a fast disk
MIN_CORES_TO_CHECKSUM = 4  # by default: the checksum threads need cores of their own beside the reads


def checksums_by_default() -> bool:
    return len(allowed_cores()) >= MIN_CORES_TO_CHECKSUM


def _into(ftw: FtwCheckpoint, entry: TensorEntry, dest: torch.Tensor) -> torch.Tensor:
    """Read straight into `dest` when layouts agree, else through a host buffer (dtype or device differ).
    Returns the host tensor holding the entry's bytes as stored."""
    if dest.device.type == "cpu" and dest.dtype == entry.torch_dtype and dest.is_contiguous():
        ftw.read_into(entry, dest)
        return dest
    stored = ftw.read(entry)
    dest.copy_(stored)
    return stored


def _dequantized_into(
    ftw: FtwCheckpoint, entry: TensorEntry, dest: torch.Tensor, folder: Path
) -> torch.Tensor:
    """A bank of codec blocks the runtime does not compute from, dequantised into `dest` (the pool dtype)
    by the codec's reference. Returns the blocks as stored."""
    codec = get_codec(entry.codec or "")
    width = codec.row_bytes(dest.shape[-1])
    if entry.shape != (*dest.shape[:-1], width):
        raise FreeTokenError(
            f"{folder}: bank {entry.name} has shape {list(entry.shape)}, expected "
            f"{[*dest.shape[:-1], width]} ({codec.name} blocks)"
        )
    stored = ftw.read(entry)
    dest.copy_(torch.from_numpy(codec.dequantize(stored.numpy(), dest.shape[-1], entry.name)))
    return stored


class Checksums:
    """The crc32 of each tensor's bytes as loaded, on worker threads; `check` waits and compares."""

    def __init__(self, threads: int = CHECKSUM_THREADS) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="freetoken-crc")
        self.pending: list[tuple[TensorEntry, Future[int]]] = []

    def add(self, entry: TensorEntry, stored: torch.Tensor) -> None:
        data = memoryview(stored.view(torch.uint8).reshape(-1).numpy())  # holds `stored` until computed
        self.pending.append((entry, self.pool.submit(zlib.crc32, data)))

    def check(self, folder: Path) -> None:
        bad = [entry.name for entry, crc in self.pending if crc.result() != entry.crc32]
        if bad:
            shown = ", ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
            raise FreeTokenError(
                f"{folder}: checksum mismatch in {shown}: the files changed since they were converted "
                "(convert again, or load with --no-verify)"
            )


def ftw_weights(
    folder: Path,
    verify: bool | None = None,
    keep_stored: frozenset[str] = frozenset(),
    all_stored: bool = False,
) -> Callable[..., HostExpertPool]:
    """`verify`: checksum every tensor as it loads (True), never (False), or where the cores allow (None).
    `keep_stored`: codecs whose banks the pool keeps as stored; banks of other codecs are dequantised;
    `all_stored`: keep them only if every layer keeps its experts as stored (for expert slots)."""

    def load(model: nn.Module, cfg: ModelConfig, dtype: torch.dtype, progress: ProgressFn | None = None):
        ftw = FtwCheckpoint(folder)  # the manifest and every shard's size are checked here
        checksum = checksums_by_default() if verify is None else verify
        checksums = Checksums() if checksum else None
        try:
            return _load(ftw, folder, model, cfg, dtype, progress, checksums, keep_stored, all_stored)
        finally:
            if checksums is not None:
                checksums.pool.shutdown(cancel_futures=True)

    return load


def _load(
    ftw: FtwCheckpoint,
    folder: Path,
    model: nn.Module,
    cfg: ModelConfig,
    dtype: torch.dtype,
    progress: ProgressFn | None,
    checksums: Checksums | None,
    keep_stored: frozenset[str],
    all_stored: bool,
) -> HostExpertPool:
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
    stored = {}
    for layer in cfg.moe_layers:
        names = (banks[(layer, "gate_up")].codec, banks[(layer, "down")].codec)
        if names[0] is not None and names[1] is not None and set(names) <= keep_stored:
            stored[layer] = (get_codec(names[0]), get_codec(names[1]))
    if all_stored:
        stored = in_every_layer(stored, cfg.moe_layers)
    pool = HostExpertPool.allocate(
        cfg.moe_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, stored=stored,
        fn=expert_fn_of(cfg), biased=cfg.expert_bias,
    )  # fmt: skip
    bias_kinds = ("gate_up_bias", "down_bias") if cfg.expert_bias else ()
    for kind in bias_kinds:
        banks.update({(e.layer, e.kind): e for e in ftw.entries if e.kind == kind})
    absent = [(layer, kind) for layer in cfg.moe_layers for kind in bias_kinds if (layer, kind) not in banks]
    if absent:
        raise FreeTokenError(f"{folder}: manifest lacks expert biases {absent[:4]}")
    total, done = ftw.nbytes, 0
    with torch.no_grad():
        for name, entry in dense.items():
            if tuple(params[name].shape) != entry.shape:
                raise FreeTokenError(
                    f"{folder}: tensor {name} has shape {list(entry.shape)}, expected "
                    f"{list(params[name].shape)}"
                )
            stored = _into(ftw, entry, params[name].data)
            if checksums is not None:
                checksums.add(entry, stored)
            done += entry.nbytes
            if progress is not None:
                progress(done, total)
        for layer in cfg.moe_layers:
            dests = [("gate_up", pool.gate_up[layer]), ("down", pool.down[layer])]
            if cfg.expert_bias:
                dests += [("gate_up_bias", pool.gate_up_bias[layer]), ("down_bias", pool.down_bias[layer])]
            for kind, dest in dests:
                entry = banks[(layer, kind)]
                if entry.codec is not None and layer not in pool.stored:
                    stored = _dequantized_into(ftw, entry, dest, folder)
                else:
                    if entry.shape != tuple(dest.shape):
                        raise FreeTokenError(
                            f"{folder}: bank {entry.name} has shape {list(entry.shape)}, "
                            f"expected {list(dest.shape)}"
                        )
                    stored = _into(ftw, entry, dest)
                if checksums is not None:
                    checksums.add(entry, stored)
                done += entry.nbytes
                if progress is not None:
                    progress(done, total)
    if checksums is not None:
        checksums.check(folder)
    pool.mark_filled()
    return pool

"""Build a model and fill it from whatever MODEL is: an HF folder, an FTW folder, a GGUF file, or a
weight source given by the caller (random weights in memory)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from freetoken.errors import FreeTokenError
from freetoken.formats.ftw import is_ftw
from freetoken.formats.safetensors_dir import SafetensorsCheckpoint
from freetoken.runtime.config import EngineConfig, ModelConfig
from freetoken.runtime.devices import resolve_dtype
from freetoken.runtime.loading.ftw_load import ftw_weights
from freetoken.runtime.loading.gguf_load import is_gguf, open_gguf
from freetoken.runtime.loading.weights import ProgressFn, load_weights
from freetoken.runtime.models import get_architecture, load_model_config
from freetoken.runtime.moe.executor import resolve_backend
from freetoken.runtime.moe.pool import HostExpertPool
from freetoken.runtime.text.tokenizer import Tokenizer

WeightSource = Callable[[nn.Module, ModelConfig, torch.dtype, "ProgressFn | None"], HostExpertPool]


@dataclass
class LoadedModel:
    config: ModelConfig
    tokenizer: Tokenizer
    model: nn.Module
    pool: HostExpertPool
    dtype: torch.dtype  # the compute dtype: the one asked, or what `auto` chose for this checkpoint


def materialise(model: nn.Module, device: torch.device) -> None:
    """`Module.to_empty`: every meta parameter and buffer becomes uninitialised memory on `device`. Made
    with torch.empty of the shape, not empty_like: empty_like of a meta tensor runs torch's Python
    reference, which imports torch.fx's symbolic shapes (~0.35 s of every command's start)."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            fresh = torch.empty(param.shape, dtype=param.dtype, device=device)
            setattr(module, name, nn.Parameter(fresh, requires_grad=param.requires_grad))
        for name, buf in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.empty(buf.shape, dtype=buf.dtype, device=device))


def stored_expert_codecs(
    config: EngineConfig, backend: str, device: torch.device
) -> tuple[frozenset[str], bool]:
    """(codecs whose expert blocks the pool keeps as the file stores them, whether every layer must keep
    its experts as stored for any to be). Every expert computed on this CPU from the pool (the cpu backend
    on a cpu device with no slots): what the CPU expert kernel computes from. Otherwise what the device
    reads in place (DEVICE_CODECS: the Triton kernels on CUDA, torch's dequantisers of the used experts
    on a cpu device standing in). `fused` keeps them layer by layer; the backends with a slot bank (the
    cpu one too) in every layer or none, as slots hold blocks for every layer or values for every layer
    (pairs may differ between layers). Other codecs, and other cases, are dequantised at load."""
    from freetoken.codecs.torch_dequant import DEVICE_CODECS
    from freetoken.runtime.moe.kernels.cpu_experts import CODEC_IDS, kernel_available
    from freetoken.runtime.moe.kernels.moe_decode import triton_available

    moe = config.moe
    no_slots = moe.cache_size in (None, 0) and moe.cache_ratio is None and moe.vram_budget is None
    if backend == "cpu" and device.type == "cpu" and no_slots and kernel_available():
        return frozenset(CODEC_IDS), True
    device_kernel = device.type == "cpu" or (device.type == "cuda" and triton_available())
    kept = frozenset(DEVICE_CODECS) if device_kernel else frozenset()
    return kept, backend != "fused"


def load_model(
    config: EngineConfig,
    device: torch.device,
    progress: ProgressFn | None = None,
    weights: WeightSource | None = None,
) -> LoadedModel:
    path = Path(config.model_path)
    gguf = None
    if is_gguf(path):
        model_config, tokenizer, gguf = open_gguf(path)
    elif path.is_dir():
        model_config, tokenizer = load_model_config(path), Tokenizer.from_dir(path)
    else:
        raise FreeTokenError(f"{path}: model folder not found")
    backend = resolve_backend(config.moe, device, bool(model_config.moe_layers))  # a bad name fails first
    dtype = resolve_dtype(config.dtype, device, model_config.torch_dtype)
    arch = get_architecture(model_config.architecture)
    with torch.device("meta"):
        model = arch.build_model(model_config).to(dtype)
    materialise(model, device)
    model.tie_weights()
    keep, all_stored = stored_expert_codecs(config, backend, device)
    if weights is None and is_ftw(path):
        weights = ftw_weights(path, verify=config.verify, keep_stored=keep, all_stored=all_stored)
    if weights is not None:
        pool = weights(model, model_config, dtype, progress)
    else:
        with gguf or SafetensorsCheckpoint(path) as ckpt:
            naming = arch.naming(gguf is not None)
            pool = load_weights(model, model_config, ckpt, naming, dtype, progress, keep, all_stored)
    if device.type == "cuda":
        pool.pin()  # only now, once every bank is filled
    return LoadedModel(model_config, tokenizer, model, pool, dtype)

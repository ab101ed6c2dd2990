"""Options shared by commands, as Annotated aliases."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from freetoken.runtime.config import (
    CHECKPOINT_POLICIES,
    check_choice,
    check_device,
    check_flags,
    normalize_dtype,
)
from freetoken.runtime.json_keys import Kind

if TYPE_CHECKING:
    from freetoken.runtime.config import MoeConfig


def checked(check: Callable[[Any], object]) -> Callable[[Any], Any]:
    """An option callback: `check(value)` raises a FreeTokenError that names the flag (the app's group
    prints it as one line, exit code 2) before the command runs; the value passes through unchanged."""

    def callback(value: Any) -> Any:
        if value is not None:
            check(value)
        return value

    return callback


def in_kind(flag: str, kind: Kind) -> Callable[[Any], Any]:
    """An option callback: the value must be of `kind` (finite numbers, ranges: see json_keys)."""
    return checked(lambda value: check_flags((flag, value, kind)))


ModelArg = Annotated[
    str,
    typer.Argument(
        help="A local HF model folder, a repo id already in the local Hugging Face cache, or 'demo' "
        "(a small random-weight Qwen3-MoE, created on first use).",
        show_default=True,
    ),
]
DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        callback=checked(check_device),
        help="Compute device: auto (CUDA when present), cpu, cuda, cuda:N.",
    ),
]
DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype",
        callback=checked(normalize_dtype),
        help="Compute dtype: auto (bfloat16 on CUDA; on the CPU a bfloat16 checkpoint stays bfloat16, "
        "others are widened to float32), float32, bfloat16.",
    ),
]
MoeBackendOpt = Annotated[
    str,
    typer.Option(
        "--moe-backend",
        help="Where routed experts run: auto (cpu without CUDA, else offload, or hybrid when both "
        "bandwidths are given and B_H > B_P), fused (every expert on the GPU), offload (misses fetched "
        "into the GPU slot cache), cpu (misses computed on the CPU), hybrid (misses split by "
        "q* = m·B_P/B_H).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of human output.")]
CacheSizeOpt = Annotated[
    int | None,
    typer.Option("--moe-cache-size", help="Expert slots on the compute device (default: from free VRAM)."),
]
CacheRatioOpt = Annotated[
    float | None,
    typer.Option("--moe-cache-ratio", help="Expert slots as a fraction of the expert pool, in (0, 1]."),
]
KvReserveOpt = Annotated[
    int,
    typer.Option(
        "--kv-reserve-tokens",
        help="Tokens of K/V to keep VRAM for (the prefix cache's copies) beyond the static KV cache of "
        "--max-running-requests × --context-length, before sizing the expert slots.",
    ),
]
VramBudgetOpt = Annotated[
    str | None,
    typer.Option(
        "--vram-budget",
        help="Cap the engine's device memory (weights, KV cache and expert slots): GiB ('20', '20GiB', "
        "'512MiB') or a share of the device ('0.5', '50%'). The expert slots get what the rest leaves and "
        "are re-split when the KV cache grows.",
    ),
]
CpuLayersOpt = Annotated[
    str | None,
    typer.Option(
        "--moe-cpu-layers",
        help="Layers whose misses compute on the CPU under offload: ids '3,7,11', a count '4' (the first "
        "four MoE layers) or a fraction '0.25'.",
    ),
]
MaxFetchOpt = Annotated[
    int | None, typer.Option("--moe-hybrid-max-fetch", help="Most misses hybrid fetches per layer step.")
]
PrefetchOpt = Annotated[
    int,
    typer.Option(
        "--moe-prefetch",
        help="Router-lookahead prefetch (offload, hybrid): after each MoE layer, fetch up to N experts of "
        "the next layer that co-occurrence learned while running says are likely (0: off). Check it on "
        "your own traces first: `freetoken replay routing` with the lru-prefetch policy.",
    ),
]
CpuThreadsOpt = Annotated[
    int | None,
    typer.Option(
        "--moe-cpu-threads",
        help="Most threads for CPU compute (default: the cores this process may use, less 1 beside a GPU "
        "for the launcher); fewer while other processes keep some of the cores busy.",
    ),
]
CpuInt8ActOpt = Annotated[
    bool,
    typer.Option(
        "--moe-cpu-int8-act",
        help="CPU experts kept quantized (Q8_0, K-quants, IQ4_XS, MXFP4) take int8-quantized activations, as "
        "llama.cpp does: faster decode where the cores, not memory, are the limit (a Q4_K model's "
        "cpu-backend decode 1.5x on a 16-core host, a layer 1.2x on 2 cores), slower prompts than a bf16 "
        "model's bf16 path; logits within about 1e-2 of the exact path.",
    ),
]
PcieOpt = Annotated[
    float | None,
    typer.Option("--moe-pcie-gbps", help="B_P, host-to-device expert bandwidth in GB/s (for hybrid)."),
]
HostOpt = Annotated[
    float | None,
    typer.Option("--moe-host-gbps", help="B_H, CPU expert compute bandwidth in GB/s (for hybrid)."),
]
PrefillStreamOpt = Annotated[
    str,
    typer.Option(
        "--moe-prefill-stream",
        help="Stream whole expert layers through two slot buffers during prefill (a scratch bank of two "
        "layers beside a smaller cache): auto (when the measured bandwidths say it beats on-demand misses "
        "for the chunk), on, off.",
    ),
]
PrefillHitD2dOpt = Annotated[
    bool,
    typer.Option(
        "--moe-prefill-hit-d2d",
        help="While streaming, copy experts already in a slot device-to-device; only misses cross PCIe.",
    ),
]
NoPrefillOverlapOpt = Annotated[
    bool,
    typer.Option(
        "--disable-moe-prefill-overlap",
        help="Copy each layer when it is needed, then compute (no double buffering): for comparison.",
    ),
]
RecordRoutingOpt = Annotated[
    Path | None,
    typer.Option(
        "--record-routing",
        help="Write every token's expert choices (per MoE layer, with phase and request) to this .npz "
        "trace on exit, for `freetoken replay routing`.",
        dir_okay=False,
    ),
]
ContextLengthOpt = Annotated[
    int | None,
    typer.Option(
        "--context-length",
        min=1,
        help="Most tokens a sequence may hold, prompt and answer; the KV cache is allocated once for it "
        "(default: 8192 or the model's max_position_embeddings if smaller; larger values are capped to it).",
    ),
]
StateCheckpointsOpt = Annotated[
    int,
    typer.Option(
        "--state-checkpoints",
        min=0,
        help="Recurrent-state checkpoints kept for the conversation (hybrid models such as Qwen3.5/3.6-MoE): "
        "an edited context resumes from the deepest one before the edit.",
    ),
]
CheckpointPolicyOpt = Annotated[
    str,
    typer.Option(
        "--checkpoint-policy",
        callback=checked(lambda value: check_choice("--checkpoint-policy", value, CHECKPOINT_POLICIES)),
        help="Where state checkpoints are taken: anchors (chat-template block boundaries: thinking, tool "
        "calls, tool outputs, turns), interval (every 64 tokens), none.",
    ),
]


def moe_config_from(flags: dict[str, Any]) -> MoeConfig:
    """The MoeConfig of the `--moe-*` flags (and --kv-reserve-tokens, --no-reprofile) among a command's
    parameters, named as `run` and `serve` both name them."""
    from freetoken.runtime.config import MoeConfig

    return MoeConfig(
        backend=flags["moe_backend"],
        cache_size=flags["moe_cache_size"],
        cache_ratio=flags["moe_cache_ratio"],
        kv_reserve_tokens=flags["kv_reserve_tokens"],
        vram_budget=flags["vram_budget"],
        cpu_layers=flags["moe_cpu_layers"],
        hybrid_max_fetch=flags["moe_hybrid_max_fetch"],
        prefetch=flags["moe_prefetch"],
        cpu_threads=flags["moe_cpu_threads"],
        cpu_int8_act=flags["moe_cpu_int8_act"],
        pcie_gbps=flags["moe_pcie_gbps"],
        host_gbps=flags["moe_host_gbps"],
        reprofile=not flags["no_reprofile"],
        prefill_stream=flags["moe_prefill_stream"],
        prefill_hit_d2d=flags["moe_prefill_hit_d2d"],
        prefill_overlap=not flags["disable_moe_prefill_overlap"],
    )

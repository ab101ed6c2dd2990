"""The engine and MoE flags that `run` and `serve` share, declared once: `@engine_flags` adds them to a
command's signature (Typer reads it) and hands the command one frozen `EngineFlags`, as `flags`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from freetoken.cli.options import (
    CacheRatioOpt,
    CacheSizeOpt,
    ContextLengthOpt,
    CpuInt8ActOpt,
    CpuLayersOpt,
    CpuThreadsOpt,
    DeviceOpt,
    DtypeOpt,
    HostOpt,
    KvReserveOpt,
    MaxFetchOpt,
    MoeBackendOpt,
    NoPrefillOverlapOpt,
    PcieOpt,
    PrefetchOpt,
    PrefillHitD2dOpt,
    PrefillStreamOpt,
    RecordRoutingOpt,
    VramBudgetOpt,
    moe_config_from,
)

if TYPE_CHECKING:
    from freetoken.runtime.config import MoeConfig

F = TypeVar("F", bound=Callable[..., Any])

MaxPrefillOpt = Annotated[
    int, typer.Option("--max-prefill-tokens", min=1, help="Prompt tokens per forward pass (bounds memory).")
]
VerifyOpt = Annotated[
    bool | None,
    typer.Option(
        "--verify/--no-verify",
        help="Check every tensor's checksum of an FTW model as it loads, beside the reads (default: when "
        "4 or more cores are free for it; the manifest and file sizes are always checked).",
        show_default=False,
    ),
]
NoReprofileOpt = Annotated[
    bool, typer.Option("--no-reprofile", help="Do not re-measure B_P and B_H while running.")
]


def _flag(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


# name, type, default: in the order `--help` lists them
SHARED = (
    _flag("device", DeviceOpt, "auto"),
    _flag("dtype", DtypeOpt, "auto"),
    _flag("context_length", ContextLengthOpt, None),
    _flag("moe_backend", MoeBackendOpt, "auto"),
    _flag("moe_cache_size", CacheSizeOpt, None),
    _flag("moe_cache_ratio", CacheRatioOpt, None),
    _flag("kv_reserve_tokens", KvReserveOpt, 8192),
    _flag("vram_budget", VramBudgetOpt, None),
    _flag("moe_cpu_layers", CpuLayersOpt, None),
    _flag("moe_hybrid_max_fetch", MaxFetchOpt, None),
    _flag("moe_prefetch", PrefetchOpt, 0),
    _flag("moe_cpu_threads", CpuThreadsOpt, None),
    _flag("moe_cpu_int8_act", CpuInt8ActOpt, False),
    _flag("moe_pcie_gbps", PcieOpt, None),
    _flag("moe_host_gbps", HostOpt, None),
    _flag("moe_prefill_stream", PrefillStreamOpt, "auto"),
    _flag("moe_prefill_hit_d2d", PrefillHitD2dOpt, False),
    _flag("disable_moe_prefill_overlap", NoPrefillOverlapOpt, False),
    _flag("record_routing", RecordRoutingOpt, None),
    _flag("max_prefill_tokens", MaxPrefillOpt, 8192),
    _flag("verify", VerifyOpt, None),
    _flag("no_reprofile", NoReprofileOpt, False),
)


@dataclass(frozen=True)
class EngineFlags:
    device: str
    dtype: str
    moe: MoeConfig
    context_length: int | None
    max_prefill_tokens: int
    verify: bool | None
    record_routing: Path | None

    @staticmethod
    def from_flags(flags: dict[str, Any]) -> EngineFlags:
        return EngineFlags(
            device=flags["device"],
            dtype=flags["dtype"],
            moe=moe_config_from(flags),
            context_length=flags["context_length"],
            max_prefill_tokens=flags["max_prefill_tokens"],
            verify=flags["verify"],
            record_routing=flags["record_routing"],
        )


def engine_flags(fn: F) -> F:
    """Give command `fn` the shared flags; it takes them as its `flags: EngineFlags` parameter."""
    own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "flags"]
    names = {p.name for p in SHARED}

    @functools.wraps(fn)
    def command(**kwargs: Any) -> Any:
        shared = {name: kwargs.pop(name) for name in names}
        return fn(flags=EngineFlags.from_flags(shared), **kwargs)

    positional = [p for p in own if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    keyword = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own if p not in positional]
    command.__signature__ = inspect.Signature([*positional, *SHARED, *keyword])  # type: ignore[attr-defined]
    command.__annotations__ = {}  # the signature carries them
    return command  # type: ignore[return-value]

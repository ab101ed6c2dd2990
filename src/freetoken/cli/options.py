"""Options shared by commands, as Annotated aliases."""

from __future__ import annotations

from typing import Annotated

import typer

ModelArg = Annotated[
    str,
    typer.Argument(
        help="A local HF model folder, a repo id already in the local Hugging Face cache, or 'demo' "
        "(a small random-weight Qwen3-MoE, created on first use).",
        show_default=True,
    ),
]
DeviceOpt = Annotated[
    str, typer.Option("--device", help="Compute device: auto (CUDA when present), cpu, cuda, cuda:N.")
]
DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype", help="Compute dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16."
    ),
]
MoeBackendOpt = Annotated[
    str,
    typer.Option(
        "--moe-backend",
        help="Where routed experts run: auto, fused (all experts on the compute device), "
        "cpu (experts computed on the host from the expert pool).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of human output.")]

"""`freetoken convert`: HF safetensors -> FTW, and `--verify` of an FTW folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from freetoken.cli.errors import reports_errors
from freetoken.cli.options import JsonOpt, in_kind
from freetoken.errors import FreeTokenError
from freetoken.runtime.config import flag_error
from freetoken.runtime.json_keys import POSITIVE

_DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
    "fp16": "float16",
    "float16": "float16",
}


def _progress_bar(description: str, quiet: bool):
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    console = Console(stderr=True)
    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=quiet or not console.is_terminal,
    ), description


@reports_errors
def convert(
    src: Annotated[
        str,
        typer.Argument(
            help="The model to convert, named as for `ft run`: 'demo', a safetensors folder or .gguf file, "
            "one of FreeToken's models, a repo id in the Hugging Face cache (with --verify: an FTW folder)."
        ),
    ],
    out: Annotated[
        str | None,
        typer.Argument(
            help="The FTW folder to write (default: NAME-ftw among FreeToken's models, so `ft run NAME-ftw` "
            "finds it)."
        ),
    ] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="Stored dtype: bf16, fp16 or fp32.")] = "bf16",
    shard_gib: Annotated[
        float,
        typer.Option(
            "--shard-gib",
            min=0.001,
            callback=in_kind("--shard-gib", POSITIVE),
            help="Largest data shard, GiB.",
        ),
    ] = 4.0,
    expert_dtype: Annotated[
        str,
        typer.Option(
            "--expert-dtype",
            help="Routed experts: 'stored' keeps a checkpoint's quantized blocks as they are (GGUF types, "
            "FP8, NVFP4: the cpu backend computes them in place); 'dtype' dequantises them to --dtype; "
            "'q8_0' or 'fp8' quantizes them (about half the bytes of bf16; fp8: one scale per 128 weights).",
        ),
    ] = "stored",
    force: Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")] = False,
    verify: Annotated[
        bool, typer.Option("--verify", help="Check every checksum of the FTW folder SRC.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write an FTW folder (experts pre-merged, 4096-aligned) that `run` loads with straight reads."""
    if verify:
        from freetoken.formats.ftw_reader import FtwCheckpoint

        ftw = FtwCheckpoint(Path(src))
        bar, what = _progress_bar("verifying", as_json)
        with bar:
            task = bar.add_task(what, total=ftw.nbytes)
            bad = ftw.verify(progress=lambda done, total: bar.update(task, completed=done))
        doc = {"folder": src, "tensors": len(ftw.entries), "bytes": ftw.nbytes, "bad": bad, "ok": not bad}
        print(
            json.dumps(doc)
            if as_json
            else f"{src}: {len(ftw.entries)} tensors, {ftw.nbytes / 2**30:.2f} GiB, "
            + ("all checksums match" if not bad else f"{len(bad)} bad")
        )
        if bad:
            raise FreeTokenError(f"{src}: checksum mismatch in {', '.join(bad[:5])}")
        return
    if dtype.lower() not in _DTYPES:
        raise flag_error("--dtype", f"expected one of bf16, fp16, fp32, got {dtype!r}")
    experts = {"stored": "stored", "dtype": "dtype", "q8_0": "Q8_0", "fp8": "FP8"}.get(expert_dtype.lower())
    if experts is None:
        raise flag_error("--expert-dtype", f"expected one of stored, dtype, q8_0, fp8, got {expert_dtype!r}")
    from freetoken.runtime.loading.convert import convert_to_ftw
    from freetoken.runtime.loading.model_ref import resolve_model

    source = resolve_model(src)
    out = out if out is not None else str(default_out(src, source))

    bar, what = _progress_bar("converting", as_json)
    with bar:
        task = bar.add_task(what, total=None)
        result = convert_to_ftw(
            source,
            Path(out),
            _DTYPES[dtype.lower()],
            int(shard_gib * 2**30),
            force,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
            expert_dtype=experts,
        )
    if as_json:
        print(json.dumps(result.as_dict()))
    else:
        d = result.as_dict()
        print(
            f"{out}: {d['tensors']} tensors in {d['shards']} shards, {result.nbytes / 2**30:.2f} GiB, "
            f"{d['seconds']:.1f} s ({d['GBps']:.2f} GB/s); experts in {', '.join(result.expert_dtypes)}"
        )


def default_out(ref: str, source: Path) -> Path:
    """NAME-ftw among FreeToken's own models: NAME the folder's or file's name for a path, else the last
    part of what was typed ('demo', a model's name, a repo id's name; a cached snapshot's folder is a
    commit hash)."""
    from freetoken.env import models_dir

    typed = Path(ref).expanduser()
    name = (source.stem if source.is_file() else source.name) if typed.exists() else ref.rsplit("/", 1)[-1]
    return models_dir() / f"{name}-ftw"

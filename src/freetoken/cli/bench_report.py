"""What `bench bw` does once parsed: measure or reuse, save, validate, report."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from freetoken.runtime.config import flag_error

GB = 1e9
VALIDATION_DISAGREED = 3  # exit code: the layer-step model's pick was not the fastest real decode


def _gbps(value: float | None) -> str:
    return "—" if value is None else f"{value / GB:.1f} GB/s"


def run_bench(
    *,
    model: str | None,
    preset: str,
    threads: int | None,
    reps: int,
    max_age_s: float | None,
    validate: bool,
    quiet: bool,
    as_json: bool,
) -> int:
    import torch

    from freetoken.runtime.measure.bandwidth import PRESETS, measure, shape_from_model
    from freetoken.runtime.measure.profile import load_profile, profile_path, save_profile, this_machine

    if model is not None:
        shape = shape_from_model(model)
    elif preset in PRESETS:
        shape = PRESETS[preset]
    else:
        raise flag_error("--preset", f"expected one of {', '.join(PRESETS)}, got {preset!r}")
    if threads:
        torch.set_num_threads(threads)
    machine = this_machine(threads)
    if max_age_s is not None:
        existing = load_profile(machine=machine)
        if existing is not None and existing.age_s() < max_age_s:
            if as_json:
                print(
                    json.dumps(
                        {
                            "skipped": True,
                            "profile": str(profile_path(machine.key)),
                            "age_s": round(existing.age_s(), 1),
                            **existing.as_dict(),
                        }
                    )
                )
            elif not quiet:
                Console(stderr=True).print(
                    f"profile {profile_path(machine.key)} is {existing.age_s() / 3600:.1f} h old: kept"
                )
            return 0
    profile = measure(shape, threads, reps)
    code = 0
    report = None
    if validate:
        from dataclasses import replace

        from freetoken.cli.bench_validate import validate_recommendation

        report = validate_recommendation(profile, shape)
        # the real decode wins over the layer-step model, unless the pick is within its noise of the fastest
        validated = {k: report[k] for k in ("tok_s", "fastest")} | {"model_pick": report["recommended"]}
        pick = report["recommended"] if report["agrees"] else report["fastest"]
        profile = replace(profile, recommended_backend=pick, validated=validated)
        code = 0 if report["agrees"] else VALIDATION_DISAGREED
    path = save_profile(profile)
    doc: dict[str, Any] = {"skipped": False, "profile": str(path), **profile.as_dict()}
    if report is not None:
        doc["validation"] = report
    if as_json:
        print(json.dumps(doc))
    elif not quiet:
        print_report(doc)
    return code


def print_report(doc: dict[str, Any]) -> None:
    console = Console()
    shape = doc["expert_shape"]
    table = Table(
        title=f"bandwidth on this machine · expert {shape['hidden']}×{shape['intermediate']} "
        f"({shape['bytes'] / 2**20:.1f} MiB), top-{shape['top_k']}, {doc['machine']['threads']} threads"
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("how")
    ratio = doc["b_h"] / doc["host_read"]
    table.add_row("host read", _gbps(doc["host_read"]), "STREAM-like read over all threads")
    table.add_row(
        "B_H", _gbps(doc["b_h"]), f"CPU expert kernel ({doc['kernel']}) at batch 1: {ratio:.2f} × host read"
    )
    for n, bw in doc.get("b_h_batch", {}).items():
        table.add_row(f"  B_H at {n} tokens", _gbps(bw), "per expert (prefill chunks)")
    table.add_row("B_P", _gbps(doc["b_p"]), "expert fills, pinned pool -> device slots")
    if doc.get("b_p_gather"):
        table.add_row("B_P (gather)", _gbps(doc["b_p_gather"]), "the same by the decode graph's UVA kernel")
    if doc.get("device_pairs_s"):
        table.add_row(
            "device experts",
            f"{doc['device_pairs_s'] / 1e6:.2f} M pairs/s",
            "(token, expert) pairs, 512 tokens",
        )
    table.add_row("H2D / D2H", f"{_gbps(doc['h2d'])} / {_gbps(doc['d2h'])}", "256 MiB pinned copies")
    table.add_row(
        "CPU branch launch", f"{doc['cpu_fixed_s'] * 1e6:.0f} µs", "hand-off, staging copies, merge"
    )
    for row in doc["overlap"]:
        table.add_row(
            f"  q = {row['q']}", f"{row['seconds'] * 1e3:.2f} ms", "both branches at once (one layer step)"
        )
    if doc["model_fetch_fraction"] is not None:
        table.add_row(
            "fetch fraction q/m",
            f"{doc['measured_fetch_fraction']:.2f} measured",
            f"linear model B_P/B_H: {doc['model_fetch_fraction']:.2f}",
        )
    table.add_row("recommended", doc["recommended_backend"], f"saved to {doc['profile']}")
    console.print(table)
    if "validation" in doc:
        v = doc["validation"]
        speeds = ", ".join(f"{name} {tok_s:.1f} tok/s" for name, tok_s in v["tok_s"].items())
        verdict = (
            f"the pick {v['recommended']} agrees"
            if v["agrees"]
            else f"the pick {v['recommended']} DISAGREES: the profile recommends {v['fastest']}, as measured"
        )
        console.print(
            f"validation ({v['layers']} layers, cache {v['cache_ratio']:.0%}, {v['tokens']} tokens): "
            f"{speeds} · fastest {v['fastest']} · {verdict}"
        )

"""`freetoken replay routing`: every policy at every capacity on the same traces, as a table, JSON, a plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from freetoken.errors import FreeTokenError
from freetoken.replay.policies import POLICIES, simulate
from freetoken.replay.trace import RoutingTrace


def parse_capacities(spec: str, pool: int) -> list[int]:
    """'0.1,0.25' fractions of the pool, '64,128' slot counts, 'a:b:step' a range of either; -> slots."""
    values: list[str] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if ":" in part:
            bits = part.split(":")
            if len(bits) != 3:
                raise FreeTokenError(f"--capacity {part!r}: a range is start:stop:step")
            try:
                start, stop, step = (float(b) for b in bits)
            except ValueError:
                raise FreeTokenError(f"--capacity {part!r}: not numbers") from None
            if step <= 0:
                raise FreeTokenError(f"--capacity {part!r}: the step must be > 0")
            fractional = any("." in b for b in bits)
            for v in np.arange(start, stop + step / 2, step):
                values.append(f"{v:.6f}" if fractional else str(round(float(v))))
        else:
            values.append(part)
    slots = []
    for value in values:
        try:
            number = float(value)
        except ValueError:
            raise FreeTokenError(f"--capacity {value!r}: not a number") from None
        count = round(number * pool) if "." in value else int(number)
        if "." in value and not 0 < number <= 1:
            raise FreeTokenError(f"--capacity {value}: a fraction of the pool must be in (0, 1]")
        if not 1 <= count <= pool:
            raise FreeTokenError(f"--capacity {value}: {count} slots, the pool holds {pool} experts")
        slots.append(count)
    if not slots:
        raise FreeTokenError("--capacity: no capacities given")
    return sorted(set(slots))


def check_same_shape(traces: Sequence[tuple[str, RoutingTrace]]) -> None:
    first_name, first = traces[0]
    for name, trace in traces[1:]:
        if (trace.num_layers, trace.num_experts) != (first.num_layers, first.num_experts):
            raise FreeTokenError(
                f"{name}: {trace.num_layers} layers of {trace.num_experts} experts, but {first_name} has "
                f"{first.num_layers} of {first.num_experts}"
            )


def run_matrix(
    traces: Sequence[tuple[str, RoutingTrace]], policies: Sequence[str], capacities: Sequence[int], warm: bool
) -> list[dict[str, Any]]:
    """One row per (policy, capacity): counts summed over the traces (each replayed from its own start)."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise FreeTokenError(f"--policy {unknown[0]!r}: expected one of {', '.join(POLICIES)}")
    check_same_shape(traces)
    pool = traces[0][1].num_layers * traces[0][1].num_experts
    rows = []
    for policy in policies:
        for capacity in capacities:
            totals = dict.fromkeys(
                ("decode_hits", "decode_misses", "prefill_hits", "prefill_misses", "fetches"), 0
            )
            for _, trace in traces:
                result = simulate(policy, trace, capacity, warm=warm)
                for key in totals:
                    totals[key] += getattr(result, key)
            decode = totals["decode_hits"] + totals["decode_misses"]
            prefill = totals["prefill_hits"] + totals["prefill_misses"]
            rows.append(
                {
                    "policy": policy,
                    "capacity": capacity,
                    "fraction": capacity / pool,
                    **totals,
                    "decode_miss_rate": totals["decode_misses"] / decode if decode else None,
                    "prefill_miss_rate": totals["prefill_misses"] / prefill if prefill else None,
                }
            )
    return rows


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("policy", "capacity", "of pool", "decode miss", "prefill miss", "decode misses", "fetches"):
        table.add_column(col, justify="right")

    def pct(v: float | None) -> str:
        return "—" if v is None else f"{v:.1%}"

    for r in rows:
        table.add_row(
            r["policy"],
            str(r["capacity"]),
            f"{r['fraction']:.0%}",
            pct(r["decode_miss_rate"]),
            pct(r["prefill_miss_rate"]),
            str(r["decode_misses"]),
            str(r["fetches"]),
        )
    Console(width=max(Console().width, 100)).print(table)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FreeTokenError("--plot needs matplotlib: pip install 'freetoken[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == policy and r["decode_miss_rate"] is not None]
        ax.plot(
            [r["fraction"] for r in mine], [r["decode_miss_rate"] for r in mine], marker="o", label=policy
        )
    ax.set_xlabel("expert cache capacity (fraction of the pool)")
    ax.set_ylabel("decode miss rate (expert reads)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)

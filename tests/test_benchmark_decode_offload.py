"""benchmarks/decode_offload.py on the cpu device (the demo shape): each backend's row, with the CPU
branch's own timings where a branch served the measured steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "decode_offload.py"


def test_rows_carry_the_cpu_branchs_timings_of_the_measured_steps() -> None:
    args = ["--small", "--device", "cpu", "--tokens", "2", "--warm", "1", "--backends", "fused,cpu", "--json"]
    run = subprocess.run([sys.executable, str(SCRIPT), *args], check=True, capture_output=True, text=True)
    rows = {r["backend"]: r for r in json.loads(run.stdout)["rows"]}
    assert rows["fused"]["cpu_branch_us"] is None
    timings = rows["cpu"]["cpu_branch_us"]
    layers = 4  # the demo model's MoE layers, every one with misses at a 37 % cache
    assert 0 < timings["layers"] <= 2 * layers  # the two measured steps', not the warm-up's
    assert timings["busy"] > 0 and timings["team_start"] <= timings["busy"]

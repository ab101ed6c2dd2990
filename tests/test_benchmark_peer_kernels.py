"""benchmarks/peer_llamacpp_kernels.py's reading of ncu's CSV: launches assembled from their metric
rows (units and thousands separators), and the quantized GEMVs told apart by the bytes they read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from peer_llamacpp_kernels import moe_gemvs, parse_ncu_csv

HEAD = '"ID","Process ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"'


def row(launch: int, name: str, metric: str, unit: str, value: str) -> str:
    return f'"{launch}","7","{name}","Command line profiler metrics","{metric}","{unit}","{value}"'


def launch(at: int, name: str, us: str, mbytes: str, grid: str) -> list[str]:
    return [
        row(at, name, "dram__bytes_read.sum", "Mbyte", mbytes),
        row(at, name, "gpu__time_duration.sum", "us", us),
        row(at, name, "launch__grid_size", "", grid),
    ]


GATE_UP = "void mul_mat_vec_q<12, 1, 1, 0, 0>(const void *)"
DOWN = "void mul_mat_vec_q<12, 1, 0, 1, 0>(const void *)"
DENSE = "void mul_mat_vec_f<__nv_bfloat16, float, 1, 256, 0, 0>(const T1 *)"


def csv_text() -> str:
    lines = ["==PROF== Connected to process", HEAD]
    lines += launch(0, GATE_UP, "13.10", "14.17", "6,144")
    lines += launch(1, DOWN, "8.62", "7.10", "4,096")
    lines += launch(2, DENSE, "9.51", "16.80", "4,096")  # more bytes than either, not a quantized GEMV
    lines += launch(3, GATE_UP, "12.90", "14.19", "6,144")
    lines += ["| model | size |", "llama-bench done"]
    return "\n".join(lines)


def test_launches_are_assembled_from_their_metric_rows() -> None:
    launches = parse_ncu_csv(csv_text())
    assert len(launches) == 4
    first = launches[0]
    assert first["name"] == GATE_UP
    assert first["seconds"] == pytest.approx(13.10e-6)
    assert first["dram_bytes"] == pytest.approx(14.17e6)
    assert first["grid"] == 6144


def test_gate_up_is_the_quantized_gemv_reading_the_most_bytes() -> None:
    found = moe_gemvs(parse_ncu_csv(csv_text()))
    assert found["gate_up"]["launches"] == 2
    assert found["gate_up"]["seconds"] == pytest.approx(13.0e-6)
    assert found["gate_up"]["dram_bytes"] == pytest.approx(14.18e6)
    assert found["down"]["seconds"] == pytest.approx(8.62e-6)
    assert found["down"]["launches"] == 1


def test_no_kernel_rows_or_one_gemv_kind_is_a_clear_error() -> None:
    with pytest.raises(SystemExit, match="no kernel rows"):
        parse_ncu_csv("==PROF== Disconnected\n")
    only_down = "\n".join([HEAD, *launch(0, DOWN, "8.62", "7.10", "4,096")])
    with pytest.raises(SystemExit, match="found 1 kind"):
        moe_gemvs(parse_ncu_csv(only_down))

"""benchmarks/agent_session.py against our own server on a tiny Qwen3.6-shaped GGUF (the cpu device):
the session grows to each turn's target, the subagent streams beside the last turn, every row reports
its prompt tokens, TTFT and decode speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SMALL = ["--layers", "4", "--hidden", "256", "--experts", "16", "--moe-inter", "256", "--shared-inter", "128",
         "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--linear-heads", "2", "--linear-dim", "32",
         "--vocab", "4096", "--expert-type", "Q4_K"]  # fmt: skip


def test_the_session_grows_to_its_targets_beside_a_subagent(tmp_path: Path) -> None:
    gguf = tmp_path / "q.gguf"
    subprocess.run([sys.executable, str(BENCHMARKS / "make_qwen35_gguf.py"), str(gguf), *SMALL], check=True,
                   capture_output=True)  # fmt: skip
    args = [str(gguf), "--turns", "800,1600,2400", "--gen", "8", "--device", "cpu", "--subagent", "--json"]
    run = subprocess.run([sys.executable, str(BENCHMARKS / "agent_session.py"), *args], check=True,
                         capture_output=True, text=True, cwd=BENCHMARKS)  # fmt: skip
    rows = json.loads(run.stdout)["freetoken"]
    assert len(rows) == 3
    for row, target in zip(rows, (800, 1600, 2400), strict=True):
        assert abs(row["prompt_tokens"] - target) < 0.1 * target, (row["prompt_tokens"], target)
        assert row["completion_tokens"] == 8 and row["ttft_s"] > 0 and row["decode_tok_s"] > 0
    assert rows[0]["decode_over_turn_1"] == 1.0
    side = rows[-1]["subagent"]
    assert "error" not in side and side["completion_tokens"] == 8 and side["prompt_tokens"] < 400


def test_llama_server_runs_the_same_session(tmp_path: Path) -> None:
    """Where llama.cpp's CPU build has llama-server (the peers' build script, TARGETS with llama-server):
    its rows, from the same messages, reach the same targets."""
    import pytest

    binary = BENCHMARKS.parent / ".peers" / "llama-build-cpu" / "bin" / "llama-server"
    if not binary.is_file():
        pytest.skip("llama-server not built (.peers/build_llamacpp.sh with TARGETS=llama-server)")
    gguf = tmp_path / "q.gguf"
    subprocess.run([sys.executable, str(BENCHMARKS / "make_qwen35_gguf.py"), str(gguf), *SMALL], check=True,
                   capture_output=True)  # fmt: skip
    args = [str(gguf), "--turns", "800,1600", "--gen", "8", "--device", "cpu", "--threads", "2", "--json",
            "--llama-server", str(binary)]  # fmt: skip
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    run = subprocess.run([sys.executable, str(BENCHMARKS / "agent_session.py"), *args], check=True,
                         capture_output=True, text=True, cwd=BENCHMARKS, env=env)  # fmt: skip
    doc = json.loads(run.stdout)
    for ours, theirs in zip(doc["freetoken"], doc["llama_cpp"], strict=True):
        assert abs(ours["prompt_tokens"] - theirs["prompt_tokens"]) < 0.05 * ours["prompt_tokens"]
        assert theirs["completion_tokens"] == 8 and theirs["decode_tok_s"] > 0

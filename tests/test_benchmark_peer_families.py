"""benchmarks/peer_families.py end to end on the CPU: a tiny OLMoE-shaped file written by its generator and
run by peer_llamacpp.py, llama.cpp's side played by a stand-in that prints llama-bench's JSON rows (the
real llama-bench's rows are tested where it is built, tests/test_peer_budgets.py and the GPU lease);
the document rewritten after every file, a second run skipping what it holds, a failing file recorded
as its error line and retried."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
TINY = "--layers 2 --hidden 256 --experts 8 --moe-inter 256 --heads 4 --kv-heads 4 --head-dim 64 --vocab 2048"
STAND_IN = """#!{python}
import json, sys
args = sys.argv[1:]
p, n = int(args[args.index("-p") + 1]), int(args[args.index("-n") + 1])
rows = [{{"n_prompt": p, "n_gen": 0, "avg_ts": 100.0}}, {{"n_prompt": 0, "n_gen": n, "avg_ts": 50.0}}]
print(json.dumps(rows))
"""


def run(tmp_path: Path, bench: Path, families: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCHMARKS.parent / "src"), str(BENCHMARKS)])}
    command = [
        sys.executable, str(BENCHMARKS / "peer_families.py"), "--llama-bench", str(bench), "--device", "cpu",
        "--threads", "2", "--families", families, "--prompt", "8", "--gen", "4", "--scratch", str(tmp_path),
        "--generator-args", TINY, "--out", str(out),
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def test_families_run_beside_the_peer_and_resume(tmp_path: Path) -> None:
    bench = tmp_path / "llama-bench"
    bench.write_text(STAND_IN.format(python=sys.executable))
    bench.chmod(bench.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "peers.json"
    first = run(tmp_path, bench, "olmoe", out)
    assert first.returncode == 0, first.stderr[-2000:]
    doc = json.loads(out.read_text())
    (entry,) = doc["entries"]
    assert entry["family"] == "olmoe" and entry["skew"] == 0.0 and entry["gguf_bytes"] > 0
    (row,) = entry["peer"]["rows"]  # on the CPU, one budget: every expert on the host for both
    assert row["llama_cpp"]["decode_tok_s"] == 50.0 and row["freetoken"]["decode_tok_s"] > 0
    assert "olmoe" in first.stdout and "llama.cpp     50.0" in first.stdout
    assert not list(tmp_path.glob("*.gguf"))  # each file deleted after its runs

    bench.write_text("#!/bin/sh\nexit 3\n")  # a peer that fails: recorded, the rest kept
    second = run(tmp_path, bench, "olmoe,qwen3moe", out)
    assert second.returncode == 0, second.stderr[-2000:]
    entries = json.loads(out.read_text())["entries"]
    assert [e["family"] for e in entries] == ["olmoe", "qwen3moe"]  # olmoe not run again
    assert entries[0] == entry and "llama-bench failed (3)" in entries[1]["error"]
    assert "error: llama-bench failed (3)" in second.stdout

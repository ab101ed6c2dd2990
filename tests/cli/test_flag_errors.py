"""Wrong flag values and broken model files: one line `error: ...` naming the flag (or file and key),
exit code 2 for a flag, found before any work; never a traceback or the parser's usage box."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from freetoken.cli.app import app

runner = CliRunner()


def one_line_error(args: list[str], code: int = 2) -> str:
    """Run the CLI; check it failed with `code` and printed exactly one `error:` line; return it."""
    result = runner.invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and "╭" not in result.output
    return lines[0]


RUN = ["run", "demo", "-p", "x", "-n", "2", "--device", "cpu"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--moe-cache-ratio", "2"], "--moe-cache-ratio: expected a number in (0, 1], got 2.0"),
        (["--moe-cache-ratio", "abc"], "--moe-cache-ratio: "),
        (["--moe-cache-ratio", "nan"], "--moe-cache-ratio: expected a number in (0, 1], got nan"),
        (["--moe-cache-size", "-4"], "--moe-cache-size: expected a non-negative integer, got -4"),
        (["--moe-cache-size", "4", "--moe-cache-ratio", "0.5"], "--moe-cache-size: give it or"),
        (["--temperature", "-1"], "--temperature: expected a number >= 0, got -1.0"),
        (["--temperature", "inf"], "--temperature: expected a number >= 0, got inf"),
        (["--top-p", "0"], "--top-p: expected a number in (0, 1], got 0.0"),
        (["--top-p", "1.5"], "--top-p: expected a number in (0, 1], got 1.5"),
        (["--top-k", "-3"], "--top-k: "),
        (["--max-tokens", "0"], "--max-tokens: "),
        (["--seed", "1e30"], "--seed: "),
        (["--seed", str(1 << 64)], f"--seed: expected a 64-bit integer, got {1 << 64}"),
        (["--moe-cpu-layers", "x,y"], "--moe-cpu-layers: expected ids '3,7,11', a count or a fraction"),
        (["--moe-cpu-layers", "-2"], "--moe-cpu-layers: -2: ids and counts are >= 0"),
        (["--moe-cpu-layers", "1.5"], "--moe-cpu-layers: 1.5: ids and counts are >= 0, a fraction is in"),
        (["--moe-backend", "nope"], "--moe-backend: expected one of auto, fused, offload, cpu, hybrid"),
        (["--device", "tpu"], "--device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
        (["--dtype", "int4"], "--dtype: unsupported dtype 'int4'"),
        (["--moe-cpu-threads", "0"], "--moe-cpu-threads: expected an integer in [1, 4096], got 0"),
        (["--moe-cpu-threads", str(10**20)], "--moe-cpu-threads: expected an integer in [1, 4096]"),
        (["--moe-pcie-gbps", "-1"], "--moe-pcie-gbps: expected a positive number, got -1.0"),
        (["--moe-host-gbps", "inf"], "--moe-host-gbps: expected a positive number, got inf"),
        (["--moe-hybrid-max-fetch", "0"], "--moe-hybrid-max-fetch: expected a positive integer, got 0"),
        (["--moe-prefetch", "200"], "--moe-prefetch: expected an integer in [0, 128], got 200"),
        (
            ["--moe-prefill-stream", "maybe"],
            "--moe-prefill-stream: expected one of auto, on, off, got 'maybe'",
        ),
        (["--kv-reserve-tokens", "-5"], "--kv-reserve-tokens: expected a non-negative integer, got -5"),
        (["--max-prefill-tokens", "0"], "--max-prefill-tokens: "),
        (["--state-checkpoints", "-1"], "--state-checkpoints: "),
        (["--checkpoint-policy", "foo"], "--checkpoint-policy: expected one of anchors, interval, none"),
    ],
)
def test_run_flags(flags: list[str], message: str) -> None:
    assert one_line_error(RUN + flags).startswith(f"error: {message}")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "0"], "--port: "),
        (["--port", "70000"], "--port: "),
        (["--max-running-requests", "0"], "--max-running-requests: "),
        (["--device", "tpu"], "--device: "),
        (["--dtype", "int4"], "--dtype: "),
        (["--moe-backend", "nope"], "--moe-backend: "),
        (["--moe-cache-ratio", "2"], "--moe-cache-ratio: "),
    ],
)
def test_serve_flags(flags: list[str], message: str) -> None:
    assert one_line_error(["serve", "demo", *flags]).startswith(f"error: {message}")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dtype", "int4"], "--dtype: expected one of bf16, fp16, fp32, got 'int4'"),
        (["--shard-gib", "inf"], "--shard-gib: expected a positive number, got inf"),
        (["--shard-gib", "0"], "--shard-gib: "),
        (["--shard-gib", "abc"], "--shard-gib: "),
    ],
)
def test_convert_flags(tiny_model: tuple[Path, Any], tmp_path: Path, flags: list[str], message: str) -> None:
    line = one_line_error(["convert", str(tiny_model[0]), str(tmp_path / "out"), *flags])
    assert line.startswith(f"error: {message}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--threads", "0"], "--threads: "),
        (["--threads", str(10**20)], "--threads: "),
        (["--reps", "x"], "--reps: "),
        (["--max-age", "3x"], "--max-age: expected a number with an optional unit"),
        (["--preset", "nope"], "--preset: expected one of qwen3-30b-a3b"),
    ],
)
def test_bench_flags(flags: list[str], message: str) -> None:
    assert one_line_error(["bench", "bw", *flags]).startswith(f"error: {message}")


def test_the_real_console_shows_one_line() -> None:
    """Outside CliRunner too: the parser's error is one line, not a box over several."""
    proc = subprocess.run(
        [sys.executable, "-m", "freetoken", "run", "--moe-cache-ratio", "abc"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --moe-cache-ratio: Input should be a valid number, unable to parse string as a number"
    ]


@pytest.fixture
def model_copy(tiny_model: tuple[Path, Any], tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model[0], folder)
    return folder


def _edit(path: Path, **changes: Any) -> None:
    raw = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**raw, **changes}))


@pytest.mark.parametrize(
    ("file", "changes", "message"),
    [
        ("config.json", {"hidden_size": -1}, "hidden_size: expected a positive integer, got -1"),
        (
            "config.json",
            {"num_local_experts": "x"},
            'num_local_experts: expected a positive integer, got "x"',
        ),
        ("config.json", {"vocab_size": None}, "vocab_size: expected a positive integer, got null"),
        ("generation_config.json", {"temperature": "hot"}, 'temperature: expected a number >= 0, got "hot"'),
        ("generation_config.json", {"top_k": [1]}, "top_k: expected a non-negative integer, got [1]"),
        (
            "tokenizer_config.json",
            {"added_tokens_decoder": [1]},
            "added_tokens_decoder: expected an object, got [1]",
        ),
    ],
)
def test_bad_model_files_are_one_line_before_loading(
    model_copy: Path, file: str, changes: dict[str, Any], message: str
) -> None:
    _edit(model_copy / file, **changes)
    line = one_line_error(["run", str(model_copy), "-p", "x", "-n", "2"], code=1)
    assert line == f"error: {model_copy / file}: {message}"


def test_invalid_json_names_the_file(model_copy: Path) -> None:
    (model_copy / "generation_config.json").write_text('{"temperature": 0.7,}')
    line = one_line_error(["run", str(model_copy), "-p", "x"], code=1)
    assert line.startswith(f"error: {model_copy / 'generation_config.json'}: invalid JSON at line 1")

"""`freetoken replay routing` / `replay session` and `run --record-routing`, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from freetoken.cli.app import app

runner = CliRunner()


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "demo.npz"
    result = runner.invoke(
        app,
        ["run", "-p", "hello there", "-n", "12", "-t", "0", "--device", "cpu", "--record-routing", str(path)],
    )
    assert result.exit_code == 0, result.output
    return path


def test_routing_json_and_plot(trace: Path, tmp_path: Path) -> None:
    plot = tmp_path / "miss.png"
    result = runner.invoke(
        app, ["replay", "routing", str(trace), "--capacity", "0.25,64", "--plot", str(plot), "--json"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    rows = {(r["policy"], r["capacity"]): r for r in doc["rows"]}
    assert {c for _, c in rows} == {32, 64}  # 0.25 of the demo's 128 experts, and 64 slots
    assert len({p for p, _ in rows}) == 8  # every policy by default
    for capacity in (32, 64):
        assert all(
            rows[("belady", capacity)]["decode_misses"] <= r["decode_misses"]
            for (p, c), r in rows.items()
            if c == capacity
        )
    assert plot.stat().st_size > 1000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--capacity", "129"], "129 slots, the pool holds 128 experts"),
        (["--capacity", "1.5"], "must be in (0, 1]"),
        (["--policy", "fifo"], "--policy 'fifo'"),
    ],
)
def test_routing_bad_arguments_are_one_line(trace: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["replay", "routing", str(trace), *args])
    assert result.exit_code == 1
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_truncated_trace_is_one_line(trace: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.npz"
    cut.write_bytes(trace.read_bytes()[:200])
    result = runner.invoke(app, ["replay", "routing", str(cut)])
    assert result.exit_code == 1 and "unreadable or truncated" in result.stderr


def test_session_generated_in_process() -> None:
    result = runner.invoke(
        app,
        [
            "replay",
            "session",
            "--generate",
            "opencode",
            "--turns",
            "3",
            "--output-tokens",
            "10",
            "--max-tokens",
            "3",
            "--window",
            "1",
            "--device",
            "cpu",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    turns = json.loads(result.stdout)["turns"]
    assert [t["turn"] for t in turns] == [0, 1, 2]
    assert turns[1]["cached_tokens"] > 0
    assert all(t["reprefilled_tokens"] == t["prompt_tokens"] - t["cached_tokens"] for t in turns)

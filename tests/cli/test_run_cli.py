"""`freetoken run` through typer's CliRunner, and the CLI's import discipline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from freetoken.cli import run as run_module
from freetoken.cli.app import app
from oracle import SUPPORTED_ARCHITECTURES

runner = CliRunner()


def invoke(*args: str, input: str | None = None) -> Any:
    return runner.invoke(app, list(args), input=input)


def test_one_shot_json_on_the_demo() -> None:
    result = invoke("run", "--prompt", "hello there", "-n", "5", "-t", "0", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout.strip().splitlines()[-1])
    assert doc["stats"]["completion_tokens"] <= 5 and doc["finish_reason"] in ("length", "stop")
    assert doc["moe_backend"] == "cpu" and doc["device"] == "cpu"  # auto without CUDA


def test_json_reports_expert_counters() -> None:
    args = ["run", "-p", "hi", "-n", "6", "-t", "0", "--device", "cpu", "--json", "--moe-backend", "hybrid"]
    result = invoke(*args, "--moe-cache-ratio", "0.25", "--moe-pcie-gbps", "25", "--moe-host-gbps", "90")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout.strip().splitlines()[-1])
    assert doc["moe_backend"] == "hybrid" and doc["expert_slots"] == 32
    experts = doc["experts"]
    assert experts["tokens"] == doc["stats"]["prompt_tokens"] + doc["stats"]["completion_tokens"] - 1
    totals = experts["totals"]
    assert totals["fills"] + totals["cpu"] == totals["misses"] > 0


def test_human_output_says_random_and_prints_speed() -> None:
    result = invoke("run", "-p", "hi", "-n", "4", "--seed", "0")
    assert result.exit_code == 0, result.output
    assert "random weights" in result.stderr
    assert "tok/s" in result.stderr


def test_stdin_prompt_and_raw(tiny_model: tuple[Path, Any]) -> None:
    folder = str(tiny_model[0])
    a = invoke("run", folder, "-p", "-", "--raw", "-n", "6", "-t", "0", "--json", input="some raw text")
    b = invoke("run", folder, "-p", "some raw text", "--raw", "-n", "6", "-t", "0", "--json")
    c = invoke("run", folder, "-p", "some raw text", "-n", "6", "-t", "0", "--json")
    assert a.exit_code == b.exit_code == c.exit_code == 0, a.output + b.output + c.output
    da, db, dc = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (a, b, c))
    assert da["text"] == db["text"] and da["stats"] == {
        **da["stats"],
        "prompt_tokens": db["stats"]["prompt_tokens"],
    }
    assert dc["stats"]["prompt_tokens"] > db["stats"]["prompt_tokens"]  # the chat template adds its tokens


def test_interactive_chat(monkeypatch: pytest.MonkeyPatch, tiny_model: tuple[Path, Any]) -> None:
    monkeypatch.setattr(run_module, "stdin_is_terminal", lambda: True)
    result = invoke(
        "run", str(tiny_model[0]), "-n", "3", "-t", "0", input="hello\nmore\n/reset\nagain\n/exit\n"
    )
    assert result.exit_code == 0, result.output
    assert sum("generated · prefill" in line for line in result.stderr.splitlines()) == 3
    assert "history cleared" in result.stderr
    # the second turn extends the first conversation, so its prefix is reused
    cached = [int(line.split("(")[1].split()[0]) for line in result.stderr.splitlines() if "cached)" in line]
    assert cached[1] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "/no/such/model", "-p", "x"], "no such model folder"),
        (["run", "demo", "-p", "   "], "empty prompt"),
        (
            ["run", "demo", "-p", "x", "--moe-backend", "offload"],
            "needs --moe-cache-size or --moe-cache-ratio",
        ),
        (
            ["run", "demo", "-p", "x", "--moe-backend", "offload", "--moe-cache-size", "3"],
            "below one layer's top-k",
        ),
        (["run", "demo", "-p", "x", "--moe-cache-size", "999"], "above the pool of 128 experts"),
        (["run", "demo", "-p", "x", "--moe-cpu-layers", "1,12"], "[12] are not MoE layers"),
    ],
)
def test_errors_are_one_line(args: list[str], message: str) -> None:
    """Errors found once the model is known (flag values alone: test_flag_errors.py)."""
    result = invoke(*args)
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_bad_model_folder_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    result = invoke("run", str(tmp_path), "-p", "x")
    assert result.exit_code == 1
    assert (
        result.stderr.strip()
        == "error: unsupported model_type 'mamba'; supported: " + SUPPORTED_ARCHITECTURES
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--version"],
        ["run", "--help"],
        ["convert", "--help"],
        ["bench", "bw", "--help"],
        ["serve", "--help"],
        ["replay", "routing", "--help"],
        ["replay", "session", "--help"],
    ],
)
def test_help_and_version_import_no_torch(args: list[str]) -> None:
    code = (
        "import sys\n"
        "from freetoken.cli.app import app\n"
        f"try:\n    app({args!r})\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_repo_id_not_in_the_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = invoke("run", "someone/some-model", "-p", "x")
    assert result.exit_code == 1
    assert "not in the local Hugging Face cache" in result.stderr


def test_nan_weights_exit_1_naming_the_model(make_model: Any) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    folder, _ = make_model("broken")
    path = next(folder.glob("*.safetensors"))
    tensors = load_file(path)
    tensors["lm_head.weight"] = torch.full_like(tensors["lm_head.weight"], float("nan"))
    save_file(tensors, path, metadata={"format": "pt"})
    result = invoke("run", str(folder), "-p", "hi", "-n", "4", "-t", "0", "--device", "cpu")
    assert result.exit_code == 1
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: {folder}") and "NaN/Inf logits" in error


def test_convert_takes_a_model_by_name_and_writes_among_freetokens_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path))
    result = invoke("convert", "demo", "--json")
    assert result.exit_code == 0, result.output
    out = tmp_path / "models" / "demo-ftw"
    assert (out / "ftw.json").exists() or any(out.iterdir())
    ran = invoke("run", "demo-ftw", "-p", "hi", "-n", "3", "-t", "0", "--device", "cpu", "--json")
    assert ran.exit_code == 0, ran.output
    assert json.loads(ran.stdout.strip().splitlines()[-1])["stats"]["completion_tokens"] <= 3
    again = invoke("convert", "demo")
    assert again.exit_code == 1 and f"{out}: exists; pass --force to replace it" in again.output

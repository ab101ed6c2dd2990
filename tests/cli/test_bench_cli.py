"""`freetoken bench bw` on a CPU-only machine, and how the runtime uses (or refuses) a profile."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from freetoken.cli.app import app
from freetoken.errors import FreeTokenError
from freetoken.runtime.config import MoeConfig
from freetoken.runtime.engine import build_engine
from freetoken.runtime.measure.profile import (
    BandwidthProfile,
    load_profile,
    profile_path,
    read_profile,
    save_profile,
    this_machine,
)
from freetoken.runtime.moe.executor import resolve_backend
from freetoken.runtime.moe.policy import fetch_fraction, quota

runner = CliRunner()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def bench(*args: str) -> Any:
    return runner.invoke(app, ["bench", "bw", "--preset", "demo", "--reps", "1", *args])


def test_cpu_only_profile_is_written_and_valid(home: Path) -> None:
    result = bench("--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    path = Path(doc["profile"])
    assert path == profile_path(this_machine().key) and path.parent == home / "profiles"
    profile = read_profile(path)
    assert profile.b_p is None and profile.h2d is None and profile.overlap == []
    assert profile.b_h > 0 and profile.host_read > 0 and profile.cpu_fixed_s > 0
    assert profile.recommended_backend == "cpu"
    assert profile.versions["torch"] == torch.__version__
    assert profile.kernel == "compiled"


def test_max_age_skips_a_fresh_profile(home: Path) -> None:
    assert bench("--quiet").exit_code == 0
    first = read_profile(profile_path(this_machine().key)).created
    result = bench("--max-age", "1h", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["skipped"] is True
    assert read_profile(profile_path(this_machine().key)).created == first
    result = bench("--max-age", "0", "--quiet")
    assert result.exit_code == 0 and result.stdout == ""
    assert read_profile(profile_path(this_machine().key)).created > first


def test_validate_on_cpu(home: Path) -> None:
    result = bench("--validate", "--json")
    assert result.exit_code == 0, result.output
    validation = json.loads(result.stdout)["validation"]
    assert validation["fastest"] == "cpu" and validation["agrees"] and validation["tok_s"]["cpu"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--preset", "nope"], "--preset: expected one of"), (["--max-age", "soon"], "--max-age: expected")],
)
def test_bad_arguments(home: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["bench", "bw", *args])
    assert result.exit_code == 2 and result.stderr.startswith(f"error: {message}")


def _profile_here(home: Path, **changes: Any):
    assert bench("--quiet").exit_code == 0
    path = profile_path(this_machine().key)
    profile = replace(read_profile(path), **changes)
    save_profile(profile, path)
    return profile


def test_foreign_and_broken_profiles_are_ignored_with_a_warning(home: Path) -> None:
    _profile_here(home, machine_key="0123456789abcdef")
    with pytest.warns(UserWarning, match="measured on another machine"):
        assert load_profile() is None
    profile_path(this_machine().key).write_text("{broken")
    with pytest.warns(UserWarning, match="invalid JSON at line 1"):
        assert load_profile() is None


def test_runtime_takes_bandwidths_from_the_profile_and_flags_win(
    home: Path, tiny_model: tuple[Path, Any]
) -> None:
    profile = _profile_here(home, b_p=20e9, b_h=80e9, recommended_backend="hybrid")
    engine = build_engine(
        tiny_model[0], device="cpu", dtype="float32", moe_backend="hybrid", cache_size=4, reprofile=False
    )
    assert engine.profile == profile
    assert engine.executor.pcie_bw == pytest.approx(20e9) and engine.executor.host_bw == pytest.approx(80e9)
    engine.configure_moe(MoeConfig("hybrid", cache_size=4, host_gbps=50.0, reprofile=False))
    assert engine.executor.host_bw == pytest.approx(50e9) and engine.executor.pcie_bw == pytest.approx(20e9)
    engine.close()


def test_auto_follows_the_recommendation_only_with_cuda() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_backend(MoeConfig(), cuda, True, "hybrid") == "hybrid"
    assert resolve_backend(MoeConfig(), cuda, True, None) == "offload"
    assert resolve_backend(MoeConfig(), cpu, True, "hybrid") == "cpu"
    assert resolve_backend(MoeConfig("offload"), cuda, True, "hybrid") == "offload"  # an explicit choice wins
    assert resolve_backend(MoeConfig(), cuda, False, "hybrid") == "fused"


@pytest.mark.parametrize("reprofile", [True, False])
def test_online_reprofiling_at_safe_points(home: Path, tiny_model: tuple[Path, Any], reprofile: bool) -> None:
    from freetoken.runtime.sampling import SamplingParams

    engine = build_engine(
        tiny_model[0],
        device="cpu",
        dtype="float32",
        moe_backend="hybrid",
        cache_size=4,
        pcie_gbps=1e-3,
        host_gbps=1e-3,
        reprofile=reprofile,
        reprofile_interval_s=0.0,
    )
    before = engine.executor.host_bw
    list(engine.generate([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True)))
    if reprofile:
        assert engine.executor.probes == 6  # one per step
        assert engine.executor.host_bw > 10 * before  # the measurements pull the absurd start up
        assert engine.executor.pcie_bw == pytest.approx(1e6)  # no device link to probe on a cpu device
    else:
        assert engine.executor.probes == 0 and engine.executor.host_bw == before
    engine.close()


def test_validation_that_disagrees_saves_the_fastest(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from freetoken.cli import bench_validate

    def disagreeing(profile, shape):
        return {
            "layers": 4,
            "cache_ratio": 0.37,
            "tokens": 8,
            "tok_s": {"offload": 10.0, "cpu": 12.0, "hybrid": 9.0},
            "fastest": "cpu",
            "recommended": "hybrid",
            "agrees": False,
        }

    monkeypatch.setattr(bench_validate, "validate_recommendation", disagreeing)
    result = bench("--validate")
    assert result.exit_code == 3, result.output
    assert "DISAGREES: the profile recommends cpu" in " ".join(result.stdout.split())  # rich wraps
    saved = read_profile(profile_path(this_machine().key))
    assert saved.recommended_backend == "cpu"
    assert saved.validated == {
        "tok_s": disagreeing(None, None)["tok_s"],
        "fastest": "cpu",
        "model_pick": "hybrid",
    }


@pytest.mark.parametrize(("measured", "want_q"), [(0.0, 0), (0.2, 1), (0.6, 3), (None, 2)])
def test_the_measured_split_sets_hybrids_fetches(measured: float | None, want_q: int) -> None:
    # m = 5 misses, B_P/B_H = 0.4 (q = 2 by the linear model); a measured best of q = 0 fetches none
    profile = BandwidthProfile(**{**_profile_doc(), "b_p": 4e9, "b_h": 10e9, "model_fetch_fraction": 0.4})
    profile = replace(profile, measured_fetch_fraction=measured)
    fraction = fetch_fraction(profile.b_p, profile.b_h, profile.fetch_correction())
    assert quota(5, fraction) == want_q


def _profile_doc() -> dict:
    profile = BandwidthProfile(
        machine_key="k",
        machine={"threads": 2},
        created=1.0,
        versions={},
        expert_shape={"hidden": 8, "intermediate": 4, "top_k": 2, "bytes": 192},
        host_read=1e10,
        b_h=5e9,
        b_p=None,
        h2d=None,
        d2h=None,
        cpu_fixed_s=1e-5,
        kernel="torch",
        b_h_batch={"4": 6e9},
    )
    return profile.as_dict()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"b_h": "fast"}, 'b_h: expected a positive number, got "fast"'),
        ({"b_p": -1}, "b_p: expected a positive number, got -1"),
        ({"overlap": [{"q": 1}]}, 'overlap: expected a list of {q, seconds} rows, got [{"q": 1}]'),
        ({"expert_shape": {"hidden": 8}}, "expert_shape.intermediate: missing"),
        ({"b_h_batch": {"four": 1e9}}, "b_h_batch.four: expected a token count as the key"),
        ({"recommended_backend": "gpu"}, "recommended_backend: expected one of fused, offload, cpu, hybrid"),
        ({"overlap_path": "graph"}, "overlap_path: expected one of stream, read_back"),
        ({"extra": 1}, "extra: unknown key"),
        ({"version": 7}, "version: expected 1, got 7"),
    ],
)
def test_bandwidth_profile_is_checked(tmp_path: Path, changes: dict, message: str) -> None:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(_profile_doc()))
    assert read_profile(path).b_h_batch == {"4": 6e9}
    path.write_text(json.dumps({**_profile_doc(), **changes}))
    with pytest.raises(FreeTokenError) as info:
        read_profile(path)
    assert str(info.value).startswith(f"{path}: {message}")


def test_run_with_a_broken_profile_warns_in_one_line(home: Path, tiny_model: tuple[Path, Any]) -> None:
    path = profile_path(this_machine().key)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**_profile_doc(), "machine_key": this_machine().key, "b_h": "x"}))
    result = runner.invoke(app, ["run", str(tiny_model[0]), "-p", "x", "-n", "1", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    warned = [line for line in result.stderr.splitlines() if "bandwidth profile" in line]
    assert warned == [
        f'warning: ignoring bandwidth profile: {path}: b_h: expected a positive number, got "x"'
    ]

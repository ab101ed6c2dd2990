"""CPU threads that share the machine: clamped to the allowed cores with a warning, and following the
cores other processes leave (busy ticks of the allowed cores less this process's own CPU time)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.runtime.engine import build_engine
from freetoken.runtime.measure.cpu_share import (
    CoreShare,
    CpuThreads,
    allowed_cores,
    clamp_threads,
    default_threads,
    read_busy_ticks,
)

STAT = """cpu  300 0 100 1000 50 0 0 0 0 0
cpu0 100 0 50 500 25 0 0 0 0 0
cpu1 200 0 50 500 25 0 0 0 0 0
intr 12345
"""


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Any:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_thread_count_above_the_allowed_cores_is_clamped_with_a_warning() -> None:
    cores = len(allowed_cores())
    with pytest.warns(UserWarning, match=f"above the {cores} cores"):
        assert clamp_threads(cores + 3) == cores
    assert clamp_threads(None) == min(cores, default_threads())  # one per physical core, at most
    assert clamp_threads(1) == 1


def test_busy_ticks_count_the_allowed_cores_only(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    assert read_busy_ticks((0,), stat) == 150  # user + system, not idle or iowait
    assert read_busy_ticks((0, 1), stat) == 400
    assert read_busy_ticks((0,), tmp_path / "missing") is None


class FakeMachine:
    """Two cores; `others` cores busy with other processes, `own` cores with this one, per second."""

    def __init__(self) -> None:
        self.t, self.others, self.own, self.busy_s, self.own_s = 0.0, 0.0, 2.0, 0.0, 0.0

    def advance(self, seconds: float) -> None:
        self.t += seconds
        self.busy_s += (self.others + self.own) * seconds
        self.own_s += self.own * seconds

    def share(self) -> CoreShare:
        return CoreShare(
            (0, 1), 0.5, lambda cores: int(self.busy_s * 100), lambda: self.own_s, lambda: self.t, 100
        )


def test_free_cores_follow_other_processes() -> None:
    machine = FakeMachine()
    share = machine.share()
    assert share.free_cores() is None  # the first sample starts an interval
    machine.advance(0.2)
    assert share.free_cores() is None  # too soon: no read at all
    machine.advance(0.4)
    assert share.free_cores() == 2  # only this process was busy
    machine.others, machine.own = 1.0, 1.0
    machine.advance(0.6)
    assert share.free_cores() == 1
    machine.others = 2.0
    machine.advance(0.6)
    assert share.free_cores() == 1  # never below one
    machine.others = 0.5  # half a core now and then: not taken
    machine.advance(0.6)
    assert share.free_cores() == 2


@pytest.mark.skipif(len(allowed_cores()) < 2, reason="needs two cores")
def test_the_engine_threads_follow_at_safe_points(tiny_model: tuple[Path, Any]) -> None:
    engine = build_engine(tiny_model[0], device="cpu", dtype="float32", moe_backend="cpu", cpu_threads=2)
    try:
        machine = FakeMachine()
        engine.cpu_threads = CpuThreads(2, machine.share())
        engine.maybe_probe()
        machine.others, machine.own = 1.0, 1.0
        machine.advance(0.6)
        engine.maybe_probe()
        assert engine.cpu_threads.current == 1 and torch.get_num_threads() == 1
        assert engine.executor.cpu.threads == 1
        machine.others, machine.own = 0.0, 1.0
        machine.advance(0.6)
        engine.maybe_probe()
        assert engine.cpu_threads.current == 2 and engine.executor.cpu.threads == 2
        assert engine.cpu_threads.changes == 2
    finally:
        engine.close()

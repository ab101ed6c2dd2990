"""Traces: recording from the engine, the file format and its errors, and `lru` replay against the
runtime cache's own counters on the same stream."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from freetoken.errors import FreeTokenError
from freetoken.replay.policies import simulate
from freetoken.replay.recorder import attach_recorder
from freetoken.replay.trace import DECODE, PREFILL, RoutingTrace, check_matches, load_trace
from freetoken.runtime.engine import build_engine
from freetoken.runtime.sampling import SamplingParams

PROMPT = [5, 77, 301, 12, 9, 250, 33, 401, 18, 2, 64, 111]


def recorded(folder: Path, cache_size: int, **kw: Any) -> tuple[Any, RoutingTrace]:
    engine = build_engine(
        folder, device="cpu", dtype="float32", moe_backend="offload", cache_size=cache_size, **kw
    )
    recorder = attach_recorder(engine)
    list(engine.generate(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True)))
    list(engine.generate([*PROMPT, 7, 7, 7], SamplingParams(max_tokens=10, ignore_eos=True)))
    return engine, recorder.trace()


def test_recording_shapes_and_phases(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    engine, trace = recorded(tiny_model[0], 4)
    # first request: 12 prompt rows + 19 decode rows; second: its uncached prompt suffix, then 9 decode rows
    assert trace.experts.shape[1:] == (2, 2) and trace.meta["moe_layers"] == [0, 2]
    assert list(trace.phase[:12]) == [PREFILL] * 12 and list(trace.phase[12:31]) == [DECODE] * 19
    assert set(trace.request[:31]) == {0} and set(trace.request[31:]) == {1}
    assert len(np.unique(trace.pass_id[:12])) == 1 and len(np.unique(trace.pass_id[12:31])) == 19
    path = trace.save(tmp_path / "t.npz")
    again = load_trace(path)
    assert np.array_equal(again.experts, trace.experts) and again.meta["num_experts"] == 8
    engine.close()


@pytest.mark.parametrize("cache_size", [2, 5, 11])
def test_lru_replay_equals_the_runtime_counters(tiny_model: tuple[Path, Any], cache_size: int) -> None:
    engine, trace = recorded(tiny_model[0], cache_size)
    totals = engine.moe_counters.totals()
    result = simulate("lru", trace, cache_size, warm=True)
    assert result.prefill_misses + result.decode_misses == totals["misses"]
    assert result.prefill_hits + result.decode_hits == totals["hits"]
    assert result.fetches == totals["fills"] + cache_size  # the warm start fills every slot once
    engine.close()


def test_bad_traces_are_one_line_errors(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    engine, trace = recorded(tiny_model[0], 4)
    engine.close()
    path = trace.save(tmp_path / "t.npz")
    truncated = tmp_path / "cut.npz"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(FreeTokenError, match="unreadable or truncated"):
        load_trace(truncated)
    with pytest.raises(FreeTokenError, match="no such trace"):
        load_trace(tmp_path / "missing.npz")
    other = tmp_path / "other.npz"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("x.npy", b"")
    with pytest.raises(FreeTokenError, match="not a routing trace"):
        load_trace(other)
    with pytest.raises(FreeTokenError, match="trace has 2 MoE layers of 8 experts, the model 4 of 8"):
        check_matches(trace, 4, 8, "--routing-trace")

"""The CPU branch's spinning team (kernels/spin_team.c): every call runs on exactly its threads, once each,
whatever the thread counts of the calls before, and returns only when all of them have."""

from __future__ import annotations

import ctypes
import random
import threading

import pytest

from freetoken.runtime.moe.kernels import loader

TEAM_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int)


@pytest.mark.parametrize("spin_ns", [0, 1_000_000])  # nap at once (the cpu device's), 1 ms (CUDA's)
def test_each_call_runs_its_threads_once_and_waits_for_them(spin_ns: int) -> None:
    lib = loader.load_library()
    assert lib is not None
    team = lib.ft_team_new(4, spin_ns)
    assert team and lib.ft_team_size(team) == 4
    seen: list[tuple[int, int]] = []
    idents: set[int] = set()
    lock = threading.Lock()
    call = [0]

    @TEAM_FN
    def fn(arg: int | None, tid: int) -> None:
        with lock:
            seen.append((call[0], tid))
            idents.add(threading.get_ident())

    try:
        rng = random.Random(0)
        expected = 0
        for i in range(120):
            call[0] = i
            threads = rng.choice((1, 2, 3, 4, 4, 6))  # more than the team: its size
            lib.ft_team_run(team, threads, ctypes.cast(fn, ctypes.c_void_p), None)
            with lock:  # every one of this call's threads ran before the call returned
                got = sorted(tid for c, tid in seen if c == i)
            assert got == list(range(min(threads, 4))), (i, threads, got)
            expected += min(threads, 4)
        assert len(seen) == expected  # no thread ran a call again after it returned
        assert len(idents) == 4  # the caller and three workers
    finally:
        lib.ft_team_free(team)


@pytest.mark.parametrize("spin_ns", [0, 1_000_000])
def test_many_calls_without_the_interpreter_between_them(spin_ns: int) -> None:
    """2,000 calls back to back in C (no interpreter lock between the threads): every call's threads, and
    only they, ran it once before it returned."""
    lib = loader.load_library()
    assert lib is not None
    assert lib.ft_team_check(3, 2000, 7, spin_ns) == 0

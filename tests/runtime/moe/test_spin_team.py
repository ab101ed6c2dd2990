"""The CPU branch's spinning team (kernels/spin_team.c): the caller runs tid 0 of every call, the workers that
arrive while it is open take distinct tids after it, and the call returns once the caller and every worker
that entered have returned — never waiting for one that has not arrived."""

from __future__ import annotations

import ctypes
import random
import threading
import time

import pytest

from freetoken.runtime.moe.kernels import loader

TEAM_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int)


@pytest.mark.parametrize("spin_ns", [0, 1_000_000])  # nap at once (the cpu device's), 1 ms (CUDA's)
def test_each_call_runs_distinct_tids_and_waits_for_those_that_entered(spin_ns: int) -> None:
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
        if tid == 0:
            time.sleep(0.002)  # the caller's share outlasts the workers' arrival (it closes the call)
        else:
            time.sleep(0.004)  # an entered worker that returns after the caller: still waited for
        with lock:
            seen.append((call[0], tid))
            idents.add(threading.get_ident())

    try:
        rng = random.Random(0)
        ran = 0
        for i in range(60):
            call[0] = i
            threads = rng.choice((1, 2, 3, 4, 4, 6))  # more than the team: its size
            lib.ft_team_run(team, threads, ctypes.cast(fn, ctypes.c_void_p), None)
            with lock:  # every thread that entered this call returned before the call did
                got = sorted(tid for c, tid in seen if c == i)
                ran = len(seen)
            assert got == list(range(len(got))) and 1 <= len(got) <= min(threads, 4), (i, threads, got)
        time.sleep(0.01)
        assert len(seen) == ran  # no thread ran a call after it returned
        assert len(idents) == 4  # the caller and three workers took part
    finally:
        lib.ft_team_free(team)


@pytest.mark.parametrize("spin_ns", [0, 1_000_000])
@pytest.mark.parametrize("held", [0, 2])
def test_many_calls_without_the_interpreter_between_them(spin_ns: int, held: int) -> None:
    """2,000 calls back to back in C (no interpreter lock between the threads): each ran tid 0 on the
    caller and distinct tids after it within its threads; with workers held out (as if the host had
    descheduled them) every call still returns, without them."""
    lib = loader.load_library()
    assert lib is not None
    result: list[int] = []
    thread = threading.Thread(
        target=lambda: result.append(lib.ft_team_check(4, 2000, 7, spin_ns, held)), daemon=True
    )
    thread.start()
    thread.join(60)
    assert result == [0], result or "a call waited for a held worker"

"""q* = m·B_P/B_H and which misses are fetched."""

from __future__ import annotations

from freetoken.runtime.moe.policy import fetch_fraction, quota


def fetch_count(
    misses: int,
    pcie_bw: float | None,
    host_bw: float | None,
    max_fetch: int | None = None,
    correction: float = 1.0,
) -> int:
    """q for m misses from the two bandwidths, as the runtime composes it."""
    return quota(misses, fetch_fraction(pcie_bw, host_bw, correction), max_fetch)


def test_balanced_split() -> None:
    assert fetch_count(8, 55e9, 94e9) == 5  # round(8 · 55/94) = round(4.68)
    assert fetch_count(4, 25e9, 100e9) == 1


def test_host_not_faster_than_pcie_fetches_everything() -> None:
    assert fetch_count(6, 50e9, 40e9) == 6
    assert fetch_count(6, 50e9, 50e9) == 6


def test_at_least_one_fill_and_the_cap() -> None:
    assert fetch_count(3, 1e9, 100e9) == 1  # round(0.03) would be 0
    assert fetch_count(8, 90e9, 100e9, max_fetch=2) == 2
    assert fetch_count(8, 50e9, 40e9, max_fetch=3) == 3
    assert fetch_count(1, 90e9, 100e9, max_fetch=4) == 1


def test_no_misses_or_no_pcie() -> None:
    assert fetch_count(0, 55e9, 94e9) == 0
    assert fetch_count(5, None, 94e9) == 0  # no accelerator link measured: all CPU


def test_fetch_fraction_is_what_the_device_policy_reads() -> None:
    assert fetch_fraction(55e9, 94e9) == 55 / 94
    assert fetch_fraction(None, 94e9) == 0.0 and fetch_fraction(55e9, None) == 1.0
    assert fetch_fraction(60e9, 50e9) == 1.0
    assert fetch_count(2, 50e9, 200e9) == 1  # floor(0.5 + 0.5): halves round up, as on the device
    assert fetch_count(6, 50e9, 400e9) == 1  # floor(0.75 + 0.5)


def test_measured_correction_moves_q() -> None:
    # bench bw measured q/m = 0.625 where the linear model said 0.934: the correction brings q to 5 of 8
    assert fetch_count(8, 52.4e9, 56.0e9) == 7
    assert fetch_count(8, 52.4e9, 56.0e9, correction=0.625 / 0.934) == 5
    assert fetch_count(8, 60e9, 50e9, correction=0.5) == 5  # even with B_H <= B_P the measurement wins
    assert fetch_count(8, 1e9, 100e9, correction=0.5) == 1  # still at least one fill


def test_recommendation_is_the_fastest_measured_split() -> None:
    from freetoken.runtime.measure.bandwidth import recommend

    rows = [{"q": q, "seconds": s} for q, s in enumerate([1.2, 1.1, 0.9, 1.0, 1.3, 1.4])]
    assert recommend(rows, 5) == ("hybrid", 0.4)
    rows[5]["seconds"] = 0.5
    assert recommend(rows, 5) == ("offload", 1.0)
    rows[0]["seconds"] = 0.4
    assert recommend(rows, 5) == ("cpu", 0.0)
    assert recommend([], 5) == ("cpu", None)

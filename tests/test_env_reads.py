"""Environment variables are read in one module, `freetoken/env.py`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "freetoken"
READS = re.compile(r"os\.environ|os\.getenv|getenv\(")


def test_only_env_py_reads_the_environment() -> None:
    readers = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "env.py" or path.parent != PACKAGE
        if READS.search(path.read_text())
    ]
    assert readers == []
    assert READS.search((PACKAGE / "env.py").read_text())  # the pattern finds reads where they are


def test_decode_tiles_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Six tiles, then optionally a split flag, the down kernel's warps, a register cap, the chunk tile,
    pdl, the gate_up's splits and rounds and the joint flag, per kind of bank; anything else is refused,
    naming the variable."""
    from freetoken.env import moe_decode_blocks

    monkeypatch.setenv("FREETOKEN_MOE_DECODE_CODEC_BLOCKS", "8,512,8,1024,4,1,1")
    monkeypatch.delenv("FREETOKEN_MOE_DECODE_BLOCKS", raising=False)
    assert moe_decode_blocks(codec=True) == (8, 512, 8, 1024, 4, 1, 1)
    assert moe_decode_blocks() is None
    monkeypatch.setenv("FREETOKEN_MOE_DECODE_INT8_BLOCKS", "8,2048,8,1024,1,1,1,2,168")
    assert moe_decode_blocks(codec=True, int8=True) == (8, 2048, 8, 1024, 1, 1, 1, 2, 168)
    assert moe_decode_blocks(codec=True) == (8, 512, 8, 1024, 4, 1, 1)
    monkeypatch.setenv("FREETOKEN_MOE_DECODE_INT8_BLOCKS", "8,2048,8,1024,1,1,1,1,0,1,1")
    assert moe_decode_blocks(codec=True, int8=True)[9:] == (1, 1)
    monkeypatch.setenv("FREETOKEN_MOE_DECODE_INT8_BLOCKS", "8,2048,8,1024,1,1,1,1,0,0,1,4")
    assert moe_decode_blocks(codec=True, int8=True)[9:] == (0, 1, 4)
    monkeypatch.setenv("FREETOKEN_MOE_DECODE_INT8_BLOCKS", "1,2048,8,1024,1,1,1,1,0,2,1,1,3")
    assert moe_decode_blocks(codec=True, int8=True)[9:] == (2, 1, 1, 3)
    monkeypatch.setenv("FREETOKEN_MOE_DECODE_INT8_BLOCKS", "1,2048,4,1024,1,1,1,1,0,0,1,1,1,1")
    assert moe_decode_blocks(codec=True, int8=True)[9:] == (0, 1, 1, 1, 1)
    bad_values = ["8,512,8,1024,4", "8,512,8,1024,4,1,2", "0,512,8,1024,4,1"]
    bad_values += [
        "8,512,8,1024,4,1,1,-1",
        "8,512,8,1024,4,1,1,1,-8",
        "1,1,1,1,1,1,1,1,1,3",
        "1,1,1,1,1,1,1,1,1,1,2",
        "1,1,1,1,1,1,1,1,1,1,1,0",
        "1,1,1,1,1,1,1,1,1,1,1,1,0",
        "1,1,1,1,1,1,1,1,1,1,1,1,1,2",
        "1,1,1,1,1,1,1,1,1,1,1,1,1,1,1",
    ]  # warps; cap; chunk tile; pdl; no splits; no rounds; joint 2; a fifteenth
    for bad in bad_values:
        monkeypatch.setenv("FREETOKEN_MOE_DECODE_BLOCKS", bad)
        with pytest.raises(ValueError, match="FREETOKEN_MOE_DECODE_BLOCKS"):
            moe_decode_blocks()

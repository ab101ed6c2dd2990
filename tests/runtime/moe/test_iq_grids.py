"""iq_grids.h holds the codebooks of ggml's i-quants as the `gguf` package's reference dequantiser has them
(its packed grids, decoded) and the sign table: rendered here from gguf, the header must be that text.
Run this file as a script to write the header again (after a `gguf` that changes a grid)."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf.quants as gq
import numpy as np

HEADER = Path(__file__).parents[3] / "src/freetoken/runtime/moe/kernels/iq_grids.h"
GRIDS = (  # C name, gguf class, bytes per entry
    ("IQ2XXS_GRID", gq.IQ2_XXS, 8),
    ("IQ2XS_GRID", gq.IQ2_XS, 8),
    ("IQ3XXS_GRID", gq.IQ3_XXS, 4),
    ("IQ3S_GRID", gq.IQ3_S, 4),
)


def _words(name: str, values: np.ndarray, width: int, per_line: int) -> list[str]:
    ctype = "uint64_t" if width == 8 else "uint32_t"
    words = values.astype(np.uint8).reshape(-1, width).copy().view(f"<u{width}").ravel()
    lines = [f"static const {ctype} {name}[{len(words)}] = {{"]
    for at in range(0, len(words), per_line):
        lines.append("    " + ", ".join(f"0x{int(w):0{2 * width}x}" for w in words[at : at + per_line]) + ",")
    return [*lines, "};"]


def render() -> str:
    lines = [
        "// The i-quants' codebooks (ggml's iq2xxs, iq2xs, iq3xxs and iq3s grids): entry i's byte j is",
        "// weight j of the group it codes (before the group's scale and signs); and ksigns: a 7-bit sign",
        "// index's byte, bit j the sign of weight j (the eighth bit makes an even count). Rendered from the",
        "// gguf package's reference tables by tests/runtime/moe/test_iq_grids.py, which checks they are",
        "// still its values.",
        "#ifndef FT_IQ_GRIDS_H",
        "#define FT_IQ_GRIDS_H",
        "#include <stdint.h>",
        "",
    ]
    for name, cls, width in GRIDS:
        cls.init_grid()
        grid = np.asarray(cls.grid).reshape(cls.grid_shape)
        lines += [*_words(name, grid, width, 4 if width == 8 else 8), ""]
    signs = np.frombuffer(gq.IQ2_XXS.ksigns, np.uint8)
    lines.append("static const uint8_t KSIGNS[128] = {")
    for at in range(0, 128, 16):
        lines.append("    " + ", ".join(f"0x{int(b):02x}" for b in signs[at : at + 16]) + ",")
    return "\n".join([*lines, "};", "", "#endif", ""])


def test_the_header_holds_ggufs_tables() -> None:
    assert HEADER.read_text() == render(), f"{HEADER.name} differs from gguf's tables: run this file"


def test_the_rendering_reads_back_as_the_grids() -> None:
    text = render()
    body = text.split("IQ3S_GRID[512] = {", 1)[1].split("};", 1)[0]
    words = np.array([int(w, 16) for w in body.replace(",", " ").split()], dtype="<u4")
    gq.IQ3_S.init_grid()
    assert np.array_equal(words.view(np.uint8).reshape(512, 4), np.asarray(gq.IQ3_S.grid).reshape(512, 4))


if __name__ == "__main__":
    HEADER.write_text(render())
    sys.exit(0)

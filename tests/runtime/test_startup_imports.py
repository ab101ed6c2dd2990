"""Loading a model pulls in none of torch's compiler stack (torch._dynamo and torch.fx's symbolic shapes
cost ~1.3 s of every command's start when something on the way touches them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

HEAVY = ("torch._dynamo", "torch.fx.experimental.symbolic_shapes")


def test_building_and_running_an_engine_imports_no_compiler_modules(tiny_model: tuple[Path, Any]) -> None:
    script = (
        "import sys\n"
        "from freetoken.runtime.engine import build_engine\n"
        "from freetoken.runtime.sampling import SamplingParams\n"
        f"engine = build_engine({str(tiny_model[0])!r}, device='cpu', dtype='bfloat16')\n"
        "list(engine.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True)))\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout

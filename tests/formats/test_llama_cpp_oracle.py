"""Second oracle: llama.cpp's own logits on the same F32 GGUF (skipped unless llama-cpp-python is installed).

With an F32 file, an F32 KV cache and flash attention off, llama.cpp's qwen3moe graph matches
transformers to about 1e-6, so it must match ours too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from freetoken.runtime.engine import build_engine
from gguf_fixture import write_gguf
from oracle import rel_err

llama_cpp = pytest.importorskip("llama_cpp")
PROMPT = [5, 77, 301, 12, 9, 250, 33, 401, 18, 2, 64, 111]


def test_llama_cpp_logits_agree(make_model: Any, tmp_path: Path) -> None:
    folder, hf = make_model(mlp_only_layers=[])  # llama.cpp's qwen3moe graph has no dense layers
    path = write_gguf(hf, folder, tmp_path / "tiny-f32.gguf", "F32")
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=64,
        logits_all=True,
        verbose=False,
        n_threads=2,
        flash_attn=False,
        type_k=0,
        type_v=0,
    )  # 0 = GGML_TYPE_F32
    llm.eval(PROMPT)
    theirs = torch.from_numpy(np.array(llm.scores[: len(PROMPT)], dtype=np.float32))
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="fused")
    ours = engine.forward(engine.new_sequence(), PROMPT, all_logits=True)
    assert rel_err(ours, theirs) < 1e-4
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))

"""Shared fixtures: tiny random Qwen3-MoE models built by transformers (the oracle) and saved to disk."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from oracle import build_hf_model

# Without CUDA, Triton kernels run in Triton's interpreter on CPU tensors; it must be chosen before
# triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(folder, transformers model in fp32) for the default tiny config."""
    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    return folder, build_hf_model(folder)


@pytest.fixture
def make_model(tmp_path: Path) -> Callable[..., tuple[Path, Any]]:
    def make(name: str = "model", **overrides: Any) -> tuple[Path, Any]:
        folder = tmp_path / name
        return folder, build_hf_model(folder, **overrides)

    return make


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep generated models (the demo) out of the user's cache; share one home across the session."""
    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path_factory.getbasetemp() / "freetoken-home"))

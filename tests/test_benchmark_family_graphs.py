"""benchmarks/family_graphs.py builds each family at its published dimensions from transformers' default
config: every one parses through the registry and builds at the stated shape."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from freetoken.runtime.models import get_architecture, load_model_config

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def family_graphs():
    spec = importlib.util.spec_from_file_location("family_graphs", BENCHMARKS / "family_graphs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["family_graphs"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", list(family_graphs().FAMILIES))
def test_each_family_is_written_at_its_shape_with_a_static_step(tmp_path: Path, family: str) -> None:
    bench = family_graphs()
    layers = bench.LAYERS.get(family, 2)
    cfg = load_model_config(bench.write_config(tmp_path, family, layers))
    assert cfg.num_layers == layers and cfg.hidden_size >= 2048 and cfg.num_experts >= 8
    with torch.device("meta"):
        model = get_architecture(cfg.architecture).build_model(cfg)
    assert len(model.model.layers) == layers

"""ModelConfig parsing from HF config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from freetoken.errors import FreeTokenError
from freetoken.runtime.config import load_model_config, rope_from_hf
from freetoken.runtime.models.rope import rope_inv_freq


def write_config(folder: Path, **fields: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    base = {
        "model_type": "qwen3_moe",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    }
    (folder / "config.json").write_text(json.dumps({**base, **fields}))
    return folder


def test_parses_qwen3_moe_fields(tmp_path: Path) -> None:
    cfg = load_model_config(
        write_config(
            tmp_path,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            norm_topk_prob=True,
            tie_word_embeddings=True,
            eos_token_id=[7, 8],
            rope_theta=5e5,
        )
    )
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 4, 2, 8)
    assert cfg.moe_layers == (1,)  # layer 3 is dense by mlp_only_layers, 0 and 2 by the sparse step
    assert cfg.norm_topk_prob and cfg.tie_word_embeddings
    assert cfg.eos_token_ids == (7, 8)
    assert cfg.rope.theta == 5e5 and cfg.rope.type == "default"


def test_num_local_experts_is_accepted(tmp_path: Path) -> None:
    folder = write_config(tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    raw["num_local_experts"] = raw.pop("num_experts")
    (folder / "config.json").write_text(json.dumps(raw))
    assert load_model_config(folder).num_experts == 8


def test_unknown_model_type_lists_supported(tmp_path: Path) -> None:
    with pytest.raises(
        FreeTokenError,
        match=r"unsupported model_type 'llama'; supported: qwen3_5_moe, qwen3_5_moe_text, qwen3_moe",
    ):
        load_model_config(write_config(tmp_path, model_type="llama"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_experts_per_tok": None}, "num_experts_per_tok"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
        ({"num_key_value_heads": 3}, "not a multiple"),
    ],
)
def test_bad_fields_are_one_line_errors(tmp_path: Path, fields: dict, message: str) -> None:
    folder = write_config(tmp_path, **fields)
    raw = json.loads((folder / "config.json").read_text())
    for key, value in fields.items():
        if value is None:
            raw.pop(key)
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(FreeTokenError, match=message) as info:
        load_model_config(folder)
    assert "\n" not in str(info.value) and "config.json" in str(info.value)


def test_missing_and_broken_config(tmp_path: Path) -> None:
    with pytest.raises(FreeTokenError, match=r"config\.json: file not found"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(FreeTokenError, match=r"config\.json: invalid JSON at line 1"):
        load_model_config(tmp_path)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 1e6},
        {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 4096},
        {
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 8.0,
            "original_max_position_embeddings": 2048,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    ],
)
def test_rope_frequencies_match_transformers(params: dict) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = Qwen3MoeConfig(head_dim=64, max_position_embeddings=16384, rope_parameters=dict(params))
    if params["rope_type"] == "default":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

        ref, ref_scale = Qwen3MoeRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg, "cpu")
    ours, scale = rope_inv_freq(
        rope_from_hf({"rope_parameters": params, "max_position_embeddings": 16384}), 64
    )
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)

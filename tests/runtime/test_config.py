"""ModelConfig parsing from HF config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken.errors import FreeTokenError
from freetoken.runtime.config import MOE_BACKEND_NAMES, EngineConfig, MoeConfig, rope_from_hf
from freetoken.runtime.loading.generation_config import generation_defaults
from freetoken.runtime.models import load_model_config
from freetoken.runtime.models.rope import rope_inv_freq
from oracle import SUPPORTED_ARCHITECTURES


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
        match=r"unsupported model_type 'llama'; supported: " + SUPPORTED_ARCHITECTURES,
    ):
        load_model_config(write_config(tmp_path, model_type="llama"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_experts_per_tok": None}, "num_experts_per_tok"),
        ({"hidden_act": "gelu"}, 'hidden_act: expected one of silu, swish, got "gelu"'),
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            'rope_scaling.rope_type: expected one of default, linear, yarn, got "dynamic"',
        ),
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


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hidden_size": -1}, "hidden_size: expected a positive integer, got -1"),
        ({"hidden_size": True}, "hidden_size: expected a positive integer, got true"),
        ({"num_experts": "x"}, 'num_experts: expected a positive integer, got "x"'),
        ({"vocab_size": None}, "vocab_size: expected a positive integer, got null"),
        ({"num_hidden_layers": [4]}, "num_hidden_layers: expected a positive integer, got [4]"),
        ({"rms_norm_eps": "small"}, 'rms_norm_eps: expected a positive number, got "small"'),
        ({"tie_word_embeddings": "yes"}, 'tie_word_embeddings: expected true or false, got "yes"'),
        ({"mlp_only_layers": 3}, "mlp_only_layers: expected a list of non-negative integers, got 3"),
        ({"eos_token_id": "end"}, 'eos_token_id: expected a token id or a list of token ids, got "end"'),
        ({"model_type": ["qwen3_moe"]}, 'model_type: expected a string, got ["qwen3_moe"]'),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok: expected at most num_experts=8, got 9"),
        ({"rope_theta": "big"}, 'rope_theta: expected a positive number, got "big"'),
        ({"rope_parameters": {"rope_type": "linear"}}, "rope_parameters.factor: missing"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": -2}},
            "rope_parameters.factor: expected a positive",
        ),
        ({"rope_scaling": [1]}, "rope_scaling: expected an object, got [1]"),
    ],
)
def test_wrong_types_and_values_name_file_and_key(tmp_path: Path, fields: dict, message: str) -> None:
    folder = write_config(tmp_path, **fields)
    with pytest.raises(FreeTokenError) as info:
        load_model_config(folder)
    assert str(info.value).startswith(f"{folder / 'config.json'}: {message}")


HYBRID_KEYS = dict(
    model_type="qwen3_5_moe_text",
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    shared_expert_intermediate_size=48,
)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"layer_types": "full_attention"}, 'layer_types: expected a list of strings, got "full_attention"'),
        ({"linear_conv_kernel_dim": "4"}, 'linear_conv_kernel_dim: expected a positive integer, got "4"'),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads: expected a multiple of linear_num_key"),
        ({"full_attention_interval": 0}, "full_attention_interval: expected a positive integer, got 0"),
    ],
)
def test_hybrid_config_keys_are_typed(tmp_path: Path, fields: dict, message: str) -> None:
    folder = write_config(tmp_path, **{**HYBRID_KEYS, **fields})
    with pytest.raises(FreeTokenError) as info:
        load_model_config(folder)
    assert str(info.value).startswith(f"{folder / 'config.json'}: {message}")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": "hot"}, 'temperature: expected a number >= 0, got "hot"'),
        ({"temperature": -0.5}, "temperature: expected a number >= 0, got -0.5"),
        ({"top_p": 0}, "top_p: expected a number in (0, 1], got 0"),
        ({"top_k": 2.5}, "top_k: expected a non-negative integer, got 2.5"),
        ({"do_sample": "no"}, 'do_sample: expected true or false, got "no"'),
    ],
)
def test_generation_config_is_checked(tmp_path: Path, fields: dict, message: str) -> None:
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(FreeTokenError) as info:
        generation_defaults(tmp_path)
    assert str(info.value) == f"{path}: {message}"


def test_generation_defaults(tmp_path: Path) -> None:
    assert generation_defaults(tmp_path) == {}
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "top_n": "x"}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    path.write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert generation_defaults(tmp_path) == {"temperature": 0.0}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: MoeConfig(backend="gpu"),
            "--moe-backend: expected one of auto, fused, offload, cpu, hybrid",
        ),
        (lambda: MoeConfig(cache_ratio=2.0), "--moe-cache-ratio: expected a number in (0, 1], got 2.0"),
        (lambda: MoeConfig(pcie_gbps=float("inf")), "--moe-pcie-gbps: expected a positive number, got inf"),
        (lambda: MoeConfig(cpu_layers="a,b"), "--moe-cpu-layers: expected ids '3,7,11'"),
        (lambda: EngineConfig(Path("m"), device="tpu"), "--device: expected auto, cpu, cuda or cuda:N"),
        (lambda: EngineConfig(Path("m"), dtype="int4"), "--dtype: unsupported dtype 'int4'"),
        (lambda: EngineConfig(Path("m"), checkpoint_policy="x"), "--checkpoint-policy: expected one of"),
        (lambda: EngineConfig(Path("m"), state_checkpoints=-1), "--state-checkpoints: expected a non-neg"),
    ],
)
def test_flag_values_are_checked_where_the_configs_are_built(make: Any, message: str) -> None:
    with pytest.raises(FreeTokenError) as info:
        make()
    assert str(info.value).startswith(message) and info.value.exit_code == 2


def test_backend_names_match_the_executor_registry() -> None:
    from freetoken.runtime.moe.executor import BACKEND_CHOICES

    assert MOE_BACKEND_NAMES == BACKEND_CHOICES


def test_tokenizer_config_keys_are_typed(tmp_path: Path) -> None:
    from freetoken.runtime.text.demo_tokenizer import write_demo_tokenizer
    from freetoken.runtime.text.tokenizer import Tokenizer

    write_demo_tokenizer(tmp_path)
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "added_tokens_decoder": "x"}))
    with pytest.raises(
        FreeTokenError, match=r"tokenizer_config\.json: added_tokens_decoder: expected an object"
    ):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [1, "2"]}')
    path.write_text("{}")
    with pytest.raises(
        FreeTokenError, match=r"generation_config\.json: eos_token_id: expected a token id or a list"
    ):
        Tokenizer.from_dir(tmp_path)

"""gpt-oss (`GptOssForCausalLM`): Qwen3-MoE's layers with biases on every attention projection and no q/k
norms, a learned sink logit per head in every softmax, a sliding window on the layers `layer_types` marks
"sliding_attention", yarn rope, a router with a bias that takes the top-k logits and then a softmax over
them, and experts with gate/up and down biases computing gpt-oss's clamped SwiGLU (moe/expert_fn.py).

transformers saves the experts per layer as [E, in, out] banks with gate and up columns alternating; the
pool takes them in its own layout (formats/tensor_names.py GPT_OSS_EXPERTS). Decoding runs over the static
KV pool (models/slot_decode.py: sinks and windows in the attention kernel, CUDA graphs on a GPU).
"""

from __future__ import annotations

from typing import Any

from freetoken.formats.tensor_names import GPT_OSS_EXPERTS, GPT_OSS_GGUF_EXPERTS
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.json_keys import BOOL, POSITIVE, POSITIVE_INT, JsonObject, Kind
from freetoken.runtime.models.base import Architecture
from freetoken.runtime.models.qwen3_moe import Qwen3MoeForCausalLM, decoder_fields

LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' defaults where a config leaves rope out (GptOssConfig)
DEFAULT_ROPE = {
    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
    "truncate": False, "original_max_position_embeddings": 4096,
}  # fmt: skip
LAYER_TYPE_LIST = Kind(
    f"a list of {' or '.join(LAYER_TYPES)}",
    lambda v: isinstance(v, list) and all(item in LAYER_TYPES for item in v),
)


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    cfg = JsonObject(raw, source)
    if not raw.get("rope_parameters") and not raw.get("rope_scaling"):
        raw = {**raw, "rope_parameters": {**DEFAULT_ROPE, "rope_theta": raw.get("rope_theta", 150000.0)}}
    fields = decoder_fields(raw, source, expert_size="intermediate_size")
    fields["attention_bias"] = cfg.get("attention_bias", BOOL, True)
    fields["rms_norm_eps"] = cfg.get("rms_norm_eps", POSITIVE, 1e-5)
    layers = fields["num_layers"]
    default_types = [LAYER_TYPES[0] if (i + 1) % 2 else LAYER_TYPES[1] for i in range(layers)]
    layer_types = cfg.get("layer_types", LAYER_TYPE_LIST, default_types)
    if len(layer_types) != layers:
        raise cfg.error(
            "layer_types", f"expected {layers} entries (num_hidden_layers), got {len(layer_types)}"
        )
    window = cfg.get("sliding_window", POSITIVE_INT, 128)
    return ModelConfig(
        architecture="gpt_oss",
        raw=raw,
        intermediate_size=0,
        norm_topk_prob=True,
        qk_norm="none",
        router_scoring="topk_softmax",
        router_bias=True,
        expert_act="clamped",
        swiglu_alpha=cfg.get("swiglu_alpha", POSITIVE, 1.702),
        swiglu_limit=cfg.get("swiglu_limit", POSITIVE, 7.0),
        expert_bias=True,
        attention_sinks=True,
        sliding_window=window,
        sliding_layers=tuple(i for i, kind in enumerate(layer_types) if kind == LAYER_TYPES[0]),
        **fields,
    )


ARCHITECTURE = Architecture(
    name="gpt_oss",
    hf_classes=("GptOssForCausalLM",),
    parse_config=parse_config,
    build_model=Qwen3MoeForCausalLM,
    expert_naming=GPT_OSS_EXPERTS,
    gguf_naming=GPT_OSS_GGUF_EXPERTS,
)

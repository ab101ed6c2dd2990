"""DeepSeek-V4's checkpoint tensor names -> the model's (transformers' module names).

Checkpoints name tensors as DeepSeek publishes them (`layers.N.attn.wq_a`, `ffn.experts.E.w1`,
`hc_attn_fn`, `attn_sink`, `compressor.ape`, `indexer.compressor.wkv`, `embed`, `head`, ...), which is
also what transformers writes back when it saves the model (under `model.`), or with transformers'
module names; both read. Routed experts come one by one (w1 gate, w3 up, w2 down) or as whole-layer
banks (gate_up_proj, down_proj). The published multi-token-prediction block (`mtp.`) is skipped.
"""

from __future__ import annotations

import re

from freetoken.formats.tensor_names import QWEN3_MOE_EXPERTS, ExpertNaming

_RENAMES = (
    ("layers.", "model.layers."),
    ("embed.", "model.embed_tokens."),
    ("norm.", "model.norm."),
    ("head.", "lm_head."),
    ("hc_head_", "model.hc_head.hc_"),
)
# applied in order, each to the whole name
_REWRITES = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"\.attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
        (r"\.attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
        (r"\.attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
        (r"\.attn\.", ".self_attn."),
        (r"\.ffn\.", ".mlp."),
        (r"\.attn_norm\.", ".input_layernorm."),
        (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
        (r"\.attn_sink$", ".sinks"),
        (r"\.ape$", ".position_bias"),
        (r"\.(self_attn|compressor|indexer)\.norm\.", r".\1.kv_norm."),
        (r"\.wq_a\.", ".q_a_proj."),
        (r"\.q_norm\.", ".q_a_norm."),
        (r"\.wq_b\.", ".q_b_proj."),
        (r"\.wkv\.", ".kv_proj."),
        (r"\.wgate\.", ".gate_proj."),
        (r"\.wo_a\.", ".o_a_proj."),
        (r"\.wo_b\.", ".o_b_proj."),
        (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
        (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
        (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
        (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    )
)

DEEPSEEK_V4_EXPERTS = ExpertNaming(
    per_expert=re.compile(
        r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight"
    ),
    fused=QWEN3_MOE_EXPERTS.fused,
    projection_parts={"w1": "gate", "w3": "up", "w2": "down", **QWEN3_MOE_EXPERTS.projection_parts},
    renames=_RENAMES,
    ignored=("mtp.",),
    rewrites=_REWRITES,
)


def published_name(name: str) -> str:
    """A name transformers saves a DeepSeek-V4 tensor under (DeepSeek's, under `model.`) -> the one
    DeepSeek's own files use (no `model.`, `embed`, `hc_head_fn`, `attn.kv_norm`): what llama.cpp's
    converter reads."""
    name = name.removeprefix("model.")
    renames = (("embed_tokens.", "embed."), ("hc_head.hc_", "hc_head_"), (".attn.norm.", ".attn.kv_norm."))
    for before, after in renames:
        name = name.replace(before, after)
    return name

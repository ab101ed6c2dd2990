"""Random-weight MoE models of any shape, written as ordinary HF folders; the built-in `demo`.

`family` picks the architecture's config and checkpoint layout: Qwen3-MoE (the demo's), Mixtral, OLMoE,
GLM-4.5 (its first layer dense, one shared expert, partial rope) or gpt-oss (sinks, sliding layers, biased
experts in transformers' fused layout), so each can be tried with no download.

Weights are drawn from a fixed seed per tensor name, so the same spec always gives the same bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from freetoken.env import models_dir
from freetoken.runtime.config import ModelConfig
from freetoken.runtime.moe.expert_fn import expert_fn_of
from freetoken.runtime.moe.pool import HostExpertPool
from freetoken.runtime.text.demo_tokenizer import write_demo_tokenizer

MARKER = "freetoken_model.json"  # present in generated folders: says the weights are random
DEMO_NAME = "demo-v1"


@dataclass(frozen=True)
class RandomModelSpec:
    num_layers: int = 4
    hidden_size: int = 256
    intermediate_size: int = 512
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    num_experts: int = 32
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 128
    vocab_size: int | None = None  # None: exactly the demo tokenizer's vocabulary
    max_position_embeddings: int = 8192
    rope_theta: float = 1_000_000.0
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    seed: int = 0
    init_std: float = 0.02
    family: str = "qwen3_moe"  # or "mixtral", "olmoe", "glm4_moe", "gpt_oss"


FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "glm4_moe", "gpt_oss")
DEMO_SPEC = RandomModelSpec()
# The shape GPU benchmarks use: Qwen3-30B-A3B (about 30.5B parameters, 57 GiB in bf16).
QWEN3_30B_A3B_SPEC = RandomModelSpec(
    num_layers=48,
    hidden_size=2048,
    intermediate_size=6144,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
)


def hf_config(spec: RandomModelSpec, vocab_size: int, eos_id: int, pad_id: int) -> dict:
    config = _qwen3_config(spec, vocab_size, eos_id, pad_id)
    if spec.family == "qwen3_moe":
        return config
    for key in (
        "num_experts",
        "moe_intermediate_size",
        "decoder_sparse_step",
        "mlp_only_layers",
        "norm_topk_prob",
    ):
        config.pop(key)
    if spec.family == "mixtral":
        config.update(model_type="mixtral", architectures=["MixtralForCausalLM"], sliding_window=None)
        config.update(num_local_experts=spec.num_experts, intermediate_size=spec.moe_intermediate_size)
    elif spec.family == "olmoe":
        config.update(model_type="olmoe", architectures=["OlmoeForCausalLM"], clip_qkv=None)
        config.update(num_experts=spec.num_experts, intermediate_size=spec.moe_intermediate_size)
    elif spec.family == "glm4_moe":
        config.update(
            model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], n_routed_experts=spec.num_experts,
            moe_intermediate_size=spec.moe_intermediate_size, first_k_dense_replace=1, n_shared_experts=1,
            n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, use_qk_norm=True,
            attention_bias=True,
        )  # fmt: skip
        config["rope_parameters"]["partial_rotary_factor"] = 0.5
    elif spec.family == "gpt_oss":
        config.update(
            model_type="gpt_oss", architectures=["GptOssForCausalLM"], num_local_experts=spec.num_experts,
            intermediate_size=spec.moe_intermediate_size, attention_bias=True, sliding_window=128,
            layer_types=[("full" if i % 2 else "sliding") + "_attention" for i in range(spec.num_layers)],
            swiglu_limit=7.0, rms_norm_eps=1e-5,
        )  # fmt: skip
    else:
        raise ValueError(f"unknown model family {spec.family!r}; one of {', '.join(FAMILIES)}")
    return config


def _qwen3_config(spec: RandomModelSpec, vocab_size: int, eos_id: int, pad_id: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "attention_bias": False,
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "norm_topk_prob": spec.norm_topk_prob,
        "decoder_sparse_step": spec.decoder_sparse_step,
        "mlp_only_layers": list(spec.mlp_only_layers),
        "tie_word_embeddings": spec.tie_word_embeddings,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": spec.dtype,
    }


def tensor_plan(spec: RandomModelSpec, vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, in the family's HF naming (experts one by one), in file order."""
    h, d, i, mi = spec.hidden_size, spec.head_dim, spec.intermediate_size, spec.moe_intermediate_size
    nq, nkv, family = spec.num_heads * d, spec.num_kv_heads * d, spec.family
    plan = [("model.embed_tokens.weight", (vocab_size, h))]
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}"
        plan += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (nq, h)),
            (f"{p}.self_attn.k_proj.weight", (nkv, h)),
            (f"{p}.self_attn.v_proj.weight", (nkv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, nq)),
        ]
        if family in ("glm4_moe", "gpt_oss"):
            plan += [(f"{p}.self_attn.{x}_proj.bias", (n,)) for x, n in (("q", nq), ("k", nkv), ("v", nkv))]
        if family == "gpt_oss":
            plan += [(f"{p}.self_attn.o_proj.bias", (h,)), (f"{p}.self_attn.sinks", (spec.num_heads,))]
        if family in ("qwen3_moe", "glm4_moe"):
            plan += [(f"{p}.self_attn.q_norm.weight", (d,)), (f"{p}.self_attn.k_norm.weight", (d,))]
        elif family == "olmoe":  # over the whole projection
            plan += [(f"{p}.self_attn.q_norm.weight", (nq,)), (f"{p}.self_attn.k_norm.weight", (nkv,))]
        if family == "glm4_moe":
            is_moe = layer >= 1
        elif family == "qwen3_moe":
            is_moe = layer not in spec.mlp_only_layers and (layer + 1) % spec.decoder_sparse_step == 0
        else:
            is_moe = True
        if family == "gpt_oss":  # transformers' layout: [E, in, out] banks, gate and up columns alternating
            e = spec.num_experts
            plan += [(f"{p}.mlp.router.weight", (e, h)), (f"{p}.mlp.router.bias", (e,))]
            q = f"{p}.mlp.experts"
            plan += [(f"{q}.gate_up_proj", (e, h, 2 * mi)), (f"{q}.gate_up_proj_bias", (e, 2 * mi))]
            plan += [(f"{q}.down_proj", (e, mi, h)), (f"{q}.down_proj_bias", (e, h))]
        elif is_moe and family == "mixtral":
            plan.append((f"{p}.block_sparse_moe.gate.weight", (spec.num_experts, h)))
            for e in range(spec.num_experts):
                q = f"{p}.block_sparse_moe.experts.{e}"
                plan += [
                    (f"{q}.w1.weight", (mi, h)),
                    (f"{q}.w3.weight", (mi, h)),
                    (f"{q}.w2.weight", (h, mi)),
                ]
        elif is_moe:
            plan.append((f"{p}.mlp.gate.weight", (spec.num_experts, h)))
            if family == "glm4_moe":
                plan.append((f"{p}.mlp.gate.e_score_correction_bias", (spec.num_experts,)))
                s = f"{p}.mlp.shared_experts"
                plan += [(f"{s}.gate_proj.weight", (mi, h)), (f"{s}.up_proj.weight", (mi, h))]
                plan.append((f"{s}.down_proj.weight", (h, mi)))
            for e in range(spec.num_experts):
                q = f"{p}.mlp.experts.{e}"
                plan += [
                    (f"{q}.gate_proj.weight", (mi, h)),
                    (f"{q}.up_proj.weight", (mi, h)),
                    (f"{q}.down_proj.weight", (h, mi)),
                ]
        else:
            plan += [
                (f"{p}.mlp.gate_proj.weight", (i, h)),
                (f"{p}.mlp.up_proj.weight", (i, h)),
                (f"{p}.mlp.down_proj.weight", (h, i)),
            ]
    plan.append(("model.norm.weight", (h,)))
    if not spec.tie_word_embeddings:
        plan.append(("lm_head.weight", (vocab_size, h)))
    return plan


def random_tensor(
    name: str, shape: tuple[int, ...], spec: RandomModelSpec, dtype: torch.dtype
) -> torch.Tensor:
    if len(shape) == 1:  # norms start at one, as trained models roughly do
        return torch.ones(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{spec.seed}:{name}".encode()))
    return (torch.randn(shape, generator=gen) * spec.init_std).to(dtype)


def write_random_model(
    out_dir: Path,
    spec: RandomModelSpec = DEMO_SPEC,
    shard_bytes: int = 4 << 30,
    progress: Callable[[int, int], None] | None = None,
    with_weights: bool = True,
) -> Path:
    """Write an HF folder (config, generation config, tokenizer, safetensors shards) for `spec`.

    The folder appears atomically: it is assembled beside `out_dir` and renamed into place. Without
    weights it holds only what an engine reads besides them (see `random_weights`).
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tok_vocab = write_demo_tokenizer(tmp)
        vocab = max(spec.vocab_size or tok_vocab, tok_vocab)
        tok = json.loads((tmp / "tokenizer.json").read_text(encoding="utf-8"))
        ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
        eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[spec.dtype]
        (tmp / "config.json").write_text(json.dumps(hf_config(spec, vocab, eos, pad), indent=2) + "\n")
        generation = {
            "eos_token_id": [eos, pad],
            "pad_token_id": pad,
            "do_sample": True,
            "temperature": 0.7,
            "top_p": 0.8,
            "top_k": 20,
        }
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        (tmp / MARKER).write_text(json.dumps({"random_weights": True, "spec": asdict(spec)}, indent=2) + "\n")
        if with_weights:
            _write_shards(tmp, tensor_plan(spec, vocab), spec, dtype, shard_bytes, progress)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _write_shards(
    folder: Path,
    plan: list[tuple[str, tuple[int, ...]]],
    spec: RandomModelSpec,
    dtype: torch.dtype,
    shard_bytes: int,
    progress: Callable[[int, int], None] | None,
) -> None:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    sizes = [itemsize * _numel(shape) for _, shape in plan]
    shards: list[list[int]] = [[]]
    filled = 0
    for index, size in enumerate(sizes):
        if shards[-1] and filled + size > shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(index)
        filled += size
    total, done = sum(sizes), 0
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" for n in range(len(shards))]
    )
    weight_map = {}
    for file_name, members in zip(names, shards, strict=True):
        tensors = {}
        for index in members:
            name, shape = plan[index]
            tensors[name] = random_tensor(name, shape, spec, dtype)
            weight_map[name] = file_name
            done += sizes[index]
            if progress is not None:
                progress(done, total)
        save_file(tensors, str(folder / file_name), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2) + "\n")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def is_random_model(model_dir: Path) -> bool:
    return (Path(model_dir) / MARKER).exists()


def ensure_demo_model(spec: RandomModelSpec = DEMO_SPEC) -> Path:
    """The built-in demo model, created on first use under the FreeToken cache folder."""
    path = models_dir() / DEMO_NAME
    if not (path / "config.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_random_model(path, spec)
    return path


def random_weights(seed: int = 0, std: float = 0.02) -> Callable[..., HostExpertPool]:
    """An engine weight source that draws every weight in memory, on the compute device, no files.

    Expert banks are drawn on the device a few experts at a time and copied into the host pool, which
    is far faster than drawing 30B host numbers on the CPU.
    """

    def fill(model: nn.Module, cfg: ModelConfig, dtype: torch.dtype, progress: Any = None) -> HostExpertPool:
        device = next(model.parameters()).device
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                if not param.is_floating_point():  # a table of expert ids (hash-routed layers)
                    param.random_(0, cfg.num_experts, generator=gen)
                elif param.dim() == 1:
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, std, generator=gen)
            pool = HostExpertPool.allocate(
                cfg.moe_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype,
                fn=expert_fn_of(cfg), biased=cfg.expert_bias,
            )  # fmt: skip
            chunk = 16
            banks = [bank for layer in pool.layers for bank in (pool.gate_up[layer], pool.down[layer])]
            for done, bank in enumerate(banks, 1):
                for start in range(0, bank.shape[0], chunk):
                    part = bank[start : start + chunk]
                    drawn = torch.empty(part.shape, dtype=torch.float32, device=device).normal_(
                        0.0, std, generator=gen
                    )
                    part.copy_(drawn.to(dtype))
                if progress is not None:
                    progress(done, len(banks))
        pool.mark_filled()
        return pool

    return fill

"""A whole decode step on the CPU in one native call (moe/kernels/decode_step_cpu.c): every layer, the
final norm and the LM head, where the Python step (models/slot_decode.py `decode_step` with the CPU ops)
makes some fifteen calls and torch ops a layer. That step is its reference: the native one rounds where
it rounds and runs the same kernels, so the two agree to bf16 rounding (summation order inside the
softmaxes aside).

It takes a grouped-query MoE model with bf16 weights — Qwen3-MoE, Mixtral, OLMoE, GLM-4.5, MiniMax-M2:
q/k norms per head, over the whole projection or none, partial rotary, clamped projections, windows and
sinks, softmax or sigmoid routers (correction bias, groups, scaling), shared experts, dense layers —
with experts in bf16 or kept as stored in a codec the expert kernel reads (cpu_experts.CODEC_IDS) and
plain SiLU between their projections, when the expert executor computes every expert on the host from
the pool (`host_banks`). It declines a step (the caller runs the Python one) while a routing recorder
listens, since the routing never leaves the call.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from torch import nn

from freetoken.runtime.kv.slot_pool import KVSlotPool
from freetoken.runtime.models.kernels.cpu_attention import NORM_MODES
from freetoken.runtime.models.slot_decode import DecodeRows
from freetoken.runtime.moe.executor import ExpertExecutor
from freetoken.runtime.moe.expert_fn import SILU
from freetoken.runtime.moe.kernels.cpu_experts import bf16_activations, codec_ids, kernel_takes
from freetoken.runtime.moe.kernels.loader import load_library, pointer
from freetoken.runtime.moe.kernels.router_topk import RouterRule

MAX_ROWS = 16
MAX_EXPERTS = 4096
MAX_HEAD_DIM = 1024
CACHE_DTYPES = (torch.bfloat16, torch.float32)
ERRORS = {-2: "a position past the KV cache", -4: "a token id outside the vocabulary"}
_P = ctypes.c_void_p
_I = ctypes.c_int


class _Layer(ctypes.Structure):
    _fields_ = [
        *[
            (name, _P)
            for name in (
                "input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "post_norm", "gate",
                "gate_up", "down", "gate_bias", "mlp_gate", "mlp_up", "mlp_down", "sinks", "k_cache",
                "v_cache",
            )
        ],
        *[(name, _I) for name in ("gu_codec", "dn_codec", "mlp_inter", "window")],
    ]  # fmt: skip


class _Decoder(ctypes.Structure):
    _fields_ = [
        *[
            (name, _I)
            for name in (
                "layers", "hidden", "heads", "kv_heads", "head_dim", "experts", "top_k", "inter", "vocab",
                "capacity", "cache_elem", "norm_topk_prob", "dense_inter", "qk_norm", "rot", "scoring",
                "n_group", "topk_group",
            )
        ],
        *[(name, ctypes.c_float) for name in ("rms_eps", "qk_eps", "clip", "routed_scaling")],
        ("layer", ctypes.POINTER(_Layer)),
        ("final_norm", _P),
        ("lm_head", _P),
        ("embed", _P),
        ("inv_freq", _P),
        ("rope_scaling", ctypes.c_float),
    ]  # fmt: skip


def _bf16(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.bfloat16 and t.is_contiguous()) for t in tensors)


class CpuDecodeStep:
    """Built once per (model, executor); call it with a step's rows -> logits [B, V] bf16, or None."""

    def __init__(
        self, model: nn.Module, pool: KVSlotPool, executor: ExpertExecutor, lib: ctypes.CDLL
    ) -> None:
        self.model, self.pool, self.executor, self.lib = model, pool, executor, lib
        self.moe_blocks = model.moe_blocks()
        self._fp32: list[torch.Tensor] = []
        self._generation = -1
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._scratch_rows = 0

    @staticmethod
    def build(model: nn.Module, pool: KVSlotPool, executor: ExpertExecutor) -> CpuDecodeStep | str:
        """The native step for this model and executor, or why it does not apply (`declined`)."""
        reason = declined(model, pool, executor)
        if reason is not None:
            return reason
        lib = load_library()
        assert lib is not None
        return CpuDecodeStep(model, pool, executor, lib)

    def _table(self) -> _Decoder:
        """The pointer table; made again whenever the KV pool's storage moves."""
        from freetoken.runtime.models.qwen3_moe import SparseMoeBlock

        model, pool, cfg = self.model, self.pool, self.model.config
        banks = self.executor.host_banks()
        assert banks is not None
        layers = (_Layer * cfg.num_layers)()
        self._fp32: list[torch.Tensor] = []  # fp32 copies the table points at, alive as long as it

        def fp32(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            self._fp32.append(t.detach().float().contiguous())
            return pointer(self._fp32[-1])

        self._inv_freq = model.rotary.inv_freq.float().contiguous()  # [rot / 2], alive as long as the table
        int8_act, bf16_act = self.executor.ctx.moe.cpu_int8_act, bf16_activations(self.executor.pool.dtype)
        widest = 0
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm != "none" else (None, None)
            kv = pool.index[attn.layer]
            moe = i in banks
            gate_up, down = banks[i] if moe else (None, None)
            gu, dn = codec_ids(self.executor.pool.codec_names(i), int8_act, bf16_act) if moe else (0, 0)
            inner = mlp.shared_experts if moe else mlp
            dense = _projections(inner) if inner is not None else (None, None, None)
            inter = dense[0].weight.shape[0] if inner is not None else 0
            widest = max(widest, inter)
            correction = getattr(mlp.gate, "e_score_correction_bias", None) if moe else None
            layers[i] = _Layer(
                pointer(layer.input_layernorm.weight), pointer(attn.qkv_weight), pointer(attn.qkv_bias),
                *map(fp32, norms), pointer(attn.o_proj.weight), pointer(attn.o_proj.bias),
                pointer(layer.post_attention_layernorm.weight),
                pointer(mlp.gate.weight) if moe else None, pointer(gate_up), pointer(down), fp32(correction),
                *(pointer(p.weight) if p is not None else None for p in dense), fp32(attn.sinks),
                pointer(pool.k[kv]), pointer(pool.v[kv]), gu, dn, inter, attn.window or 0,
            )  # fmt: skip
        self._layers = layers
        first = model.model.layers[0].self_attn
        router = next(
            (layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)), None
        )
        rule = router.rule if router is not None else RouterRule(cfg.num_experts_per_tok)
        return _Decoder(
            cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_experts,
            cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.vocab_size, pool.capacity,
            pool.k[0].element_size(), int(rule.renormalize), widest, NORM_MODES[first.qk_norm],
            cfg.rotary_dim, int(rule.scoring == "sigmoid"), rule.n_group, rule.topk_group, cfg.rms_norm_eps,
            first.q_norm.eps if first.qk_norm != "none" else 0.0, float(first.clip or 0.0),
            float(rule.scaling), layers, pointer(model.model.norm.weight),
            pointer(model.lm_head.weight), pointer(model.model.embed_tokens.weight), pointer(self._inv_freq),
            float(model.rotary.scaling),
        )  # fmt: skip

    def __call__(self, rows: DecodeRows) -> torch.Tensor | None:
        """logits [B, V] in bf16 for the step's rows (K/V written, experts counted), or None: the step
        is the Python one's to run (a routing recorder listens, or the executor now uses slots)."""
        b = rows.tokens.shape[0]
        if b > MAX_ROWS or any(block.recorder is not None for block in self.moe_blocks):
            return None
        if self.executor.host_banks() is None:
            return None
        if self._generation != self.pool.generation:
            self._decoder, self._generation = self._table(), self.pool.generation
        if self._scratch_rows < b:
            floats = self.lib.ft_decode_step_scratch(ctypes.addressof(self._decoder), b)
            self._scratch, self._scratch_rows = torch.empty(floats, dtype=torch.float32), b
        # [B] int64 each, contiguous: the decoder's rows are columns of one staged [B, 3] block
        tokens, slots, positions = (
            t.to(torch.int64).contiguous() for t in (rows.tokens, rows.slots, rows.positions)
        )
        distinct = np.empty(len(self.moe_blocks), dtype=np.int64)  # experts per MoE layer step
        logits = torch.empty(b, self.model.config.vocab_size, dtype=torch.bfloat16)
        code = self.lib.ft_decode_step(
            ctypes.addressof(self._decoder), b, tokens.data_ptr(), slots.data_ptr(), positions.data_ptr(),
            distinct.ctypes.data, logits.data_ptr(), self._scratch.data_ptr(), torch.get_num_threads(),
            self.executor.cpu_threads(),
        )  # fmt: skip
        if code in ERRORS:
            raise ValueError(f"native decode step: {ERRORS[code]}")
        if code != 0:
            raise MemoryError(f"native decode step failed (code {code})")
        self.executor.count_host_steps(distinct)
        return logits


def declined(model: nn.Module, pool: KVSlotPool, executor: ExpertExecutor) -> str | None:
    """Why the native step does not take this model and executor (what `-v` says), or None: it does."""
    from freetoken.runtime.models.layers import SwiGLUMLP
    from freetoken.runtime.models.qwen3_moe import Attention, DecoderLayer, SparseMoeBlock

    if pool.device.type != "cpu":
        return "not a CPU device"
    if load_library() is None:
        return "the CPU kernels are not built"
    if not all(type(layer) is DecoderLayer for layer in model.model.layers):
        return "not every layer is grouped-query attention (the model's own decode runs, its ops native)"
    cfg = model.config
    banks = executor.host_banks()
    if banks is None:
        return "experts are computed outside the host pool (slots on the device)"
    if pool.dtype not in CACHE_DTYPES or not pool.k[0].is_contiguous():
        return f"a {pool.dtype} KV cache"
    if cfg.num_experts > MAX_EXPERTS or cfg.head_dim > MAX_HEAD_DIM:
        return f"{cfg.num_experts} experts or a head of {cfg.head_dim} dims"
    if executor.fn != SILU or executor.pool.biased:
        return "the experts' function or biases are not plain SiLU ones"
    if cfg.n_group > 1 and cfg.num_experts % cfg.n_group:
        return f"{cfg.num_experts} experts do not split into {cfg.n_group} groups"
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, Attention) or attn.qk_norm not in NORM_MODES:
            return f"layer {i}'s attention"
        shared = mlp.shared_experts if isinstance(mlp, SparseMoeBlock) else None
        if isinstance(mlp, SparseMoeBlock) and i in banks and not routes_otherwise(mlp):
            if not kernel_takes(*banks[i], executor.pool.codec_names(i)):
                return f"layer {i}'s expert codecs {executor.pool.codec_names(i)}"
            mlp_weights = (mlp.gate.weight, *(p.weight for p in (_projections(shared) if shared else ())))
        elif isinstance(mlp, SwiGLUMLP):
            mlp_weights = tuple(p.weight for p in _projections(mlp))
        else:
            return f"layer {i}'s router"
        inner = shared if isinstance(mlp, SparseMoeBlock) else mlp
        if inner is not None and any(p.bias is not None for p in _projections(inner)):
            return f"layer {i}'s MLP has biases"
        weights = (
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight, attn.qkv_weight,
            attn.qkv_bias, attn.o_proj.weight, attn.o_proj.bias, *mlp_weights,
        )  # fmt: skip
        if not _bf16(*weights):
            return "weights not in bf16"
    if not _bf16(model.model.norm.weight, model.lm_head.weight):
        return "weights not in bf16"
    return None


def _projections(mlp: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
    return mlp.gate_proj, mlp.up_proj, mlp.down_proj


def routes_otherwise(mlp: nn.Module) -> bool:
    """Whether a routed MoE block routes other than the native step can: a softmax over every expert
    (top-k, renormalised as the config says, unscaled) or sigmoid scores with a correction bias (groups,
    scaling); no router bias, no gate on the shared experts."""
    if mlp.gate.bias is not None or getattr(mlp, "shared_expert_gate", None) is not None:
        return True
    return mlp.rule.scoring not in ("softmax", "sigmoid")

"""A decode step's attention block on the CPU in one native call (moe/kernels/attention_decode.c): q/k
RMS norm (per head, over the whole projection, or none) and rotary (on all or the first dims), the K/V
write at each row's slot and position, attention over the slot's keys (a sliding layer's window, each
head's sink logit where the model has them) — instead of some sixty small torch ops a layer. Its
reference is the two plain-torch steps it replaces (a whole-projection norm before them),
`qk_norm_rope_kv_write_reference` then `slot_decode_attention_reference`; it computes in fp32 (caches in
bf16 or fp32), so it agrees with them exactly in fp32 up to summation order, and within bf16 rounding
on a bf16 model."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.runtime.moe.kernels.loader import load_library, pointer

MAX_ROWS = 16
MAX_HEAD_DIM = 1024
MAX_KV_WIDTH = 8192  # KVH·D: the kernel holds a row's keys on its stack
NORM_MODES = {"none": 0, "head": 1, "full": 2}  # q/k norms: none, per head, over the whole projection


def native_attention_takes(qkv: torch.Tensor, k_cache: torch.Tensor, head_dim: int) -> bool:
    return (
        qkv.device.type == "cpu"
        and 0 < qkv.shape[0] <= MAX_ROWS
        and head_dim <= MAX_HEAD_DIM
        and k_cache.dtype in (torch.bfloat16, torch.float32)
        and k_cache.is_contiguous()
        and load_library() is not None
    )


def cpu_attention_block(
    qkv: torch.Tensor,
    attn: nn.Module,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor | None:
    """qkv [B, (NH + 2 KVH) D] -> attention output [B, NH D] in qkv's dtype, the K/V written; None when
    the native kernel does not take the inputs (the caller runs the torch steps)."""
    d = attn.head_dim
    if not native_attention_takes(qkv, k_cache, d) or attn.num_kv_heads * d > MAX_KV_WIDTH:
        return None
    lib = load_library()
    assert lib is not None
    b, nh, kvh, cap = qkv.shape[0], attn.num_heads, attn.num_kv_heads, k_cache.shape[2]
    f32 = torch.float32
    qkv32, cos32, sin32 = (t.to(f32).contiguous() for t in (qkv, cos, sin))
    norm = NORM_MODES[attn.qk_norm]
    qw, kw = (
        (attn.q_norm.weight.to(f32).contiguous(), attn.k_norm.weight.to(f32).contiguous())
        if norm
        else (None, None)
    )
    sinks = None if attn.sinks is None else attn.sinks.to(f32).contiguous()
    slots64, positions64 = slots.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
    scores = torch.empty(b * nh * cap, dtype=f32)
    q_scratch = torch.empty(b * nh * d, dtype=f32)
    out = torch.empty(b, nh * d, dtype=f32)
    code = lib.ft_attention_decode(
        qkv32.data_ptr(), b, nh, kvh, d, norm, cos.shape[-1], pointer(qw), pointer(kw),
        attn.q_norm.eps if norm else 0.0, cos32.data_ptr(), sin32.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), k_cache.element_size(), cap, slots64.data_ptr(), positions64.data_ptr(), d**-0.5,
        pointer(sinks), attn.window or 0, scores.data_ptr(), q_scratch.data_ptr(), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if code != 0:
        raise ValueError(
            f"native decode attention refused its inputs (code {code}): a position past the cache?"
        )
    return out.to(qkv.dtype)

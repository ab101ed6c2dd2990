"""The decode step's router as one Triton launch: softmax over the experts in fp32, top-k, optional
renormalisation over the k chosen, and the cast back, one program per row, with no host sync and shapes
fixed by the inputs (graph-capturable). Meant for decode batches (1..16 rows, E up to 512, k up to 16):
each row is held whole in registers, and top-k is k rounds of argmax-and-mask over it.

`router_topk_reference` is `qwen3_moe.SparseMoeBlock.route` after the gate. The kernel's probabilities
and weights equal the reference's up to fp32 rounding (exp and sums in another order; compiled, it uses
libdevice's exp and IEEE division as torch's CUDA softmax does), so the weights in bf16 are almost
always bit-equal and at most a bf16 ulp apart. Ids are equal wherever the k-th and (k+1)-th
probabilities are not tied. Columns come in descending probability, as torch.topk's; on exactly equal
probabilities the kernel puts the lower expert id first, whereas torch.topk's order among ties is
unspecified (so which of two tied experts makes the cut at k may differ too).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from freetoken.env import moe_decode_kernel_choice
from freetoken.runtime.models.kernels.decode_attention import check_device
from freetoken.runtime.moe.kernels.moe_decode import MAX_DECODE_TOKENS, triton_available
from freetoken.runtime.triton_support import next_pow2


@functools.cache
def _body() -> tuple[ModuleType, bool]:
    """(the kernel module, whether Triton's interpreter runs it)."""
    from triton.runtime.interpreter import InterpretedFunction

    from freetoken.runtime.moe.kernels import router_topk_triton as body

    return body, isinstance(body.router_topk_kernel, InterpretedFunction)


def router_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (fp32, bf16 or fp16; any row stride) -> (ids [T, K] int64, weights [T, K] in the
    logits' dtype), both contiguous, columns in descending probability (see the module's note on ties)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], not {tuple(logits.shape)}")
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}], not {top_k}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be fp32, bf16 or fp16, not {logits.dtype}")
    check_device(logits)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, top_k, dtype=logits.dtype, device=logits.device)
    if t == 0:
        return ids, weights
    block = next_pow2(e)
    body, interpreted = _body()
    body.router_topk_kernel[(t,)](
        logits, ids, weights, logits.stride(0),
        E=e, K=top_k, BLOCK=block, K_BLOCK=next_pow2(top_k), RENORM=renormalize,
        COMPILED=not interpreted, num_warps=max(1, min(8, block // 512)),
    )  # fmt: skip
    return ids, weights


def router_topk_reference(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseMoeBlock.route after the gate, in plain torch."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(logits.dtype)


def use_router_kernel(x: torch.Tensor) -> bool:
    """Whether the router of activations x [T, H] runs this kernel: a few rows on CUDA (the decode step),
    unless FREETOKEN_MOE_DECODE_KERNEL=torch turns the decode kernels off."""
    return x.is_cuda and x.shape[0] <= MAX_DECODE_TOKENS and _kernels_on()


@functools.cache
def _kernels_on() -> bool:
    return moe_decode_kernel_choice() != "torch" and triton_available()

"""The decode step's router as one Triton launch after the gate's GEMV: scores from the logits (softmax,
sigmoid, sqrt(softplus), or the raw logits), an optional correction bias and group limit for the choice,
top-k, the chosen scores (gpt-oss: softmaxed over the k), optional renormalisation, the scaling and the
cast, one program per row, with no host sync and shapes fixed by the inputs (graph-capturable). Meant
for decode batches (1..16 rows, E up to 512, k up to 16): each row is held whole in registers, and
top-k is k rounds of argmax-and-mask over it. Where torch ran some 15 small launches for a grouped
sigmoid router (DeepSeek-V3, GLM-4.5, MiniMax-M2) and four for a softmax one, this is one.

`choose_experts_reference` is the plain torch statement, and it is what the models run off the decode
kernels' path (prefill, the CPU), so both paths follow one rule (`RouterRule`). The kernel's scores and
weights equal the reference's up to fp32 rounding (exp and sums in another order; compiled, it uses
libdevice's exp and IEEE division as torch's CUDA kernels do), so weights in bf16 are almost always
bit-equal and at most a bf16 ulp apart. Ids are equal wherever the k-th and (k+1)-th choice values are
not tied. Columns come in descending choice value, as torch.topk's; on exactly equal values the kernel
puts the lower expert id first, whereas torch.topk's order among ties is unspecified (so which of two
tied experts makes the cut at k may differ too).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from freetoken.env import moe_decode_kernel_choice
from freetoken.runtime.models.kernels.decode_attention import check_device
from freetoken.runtime.moe.kernels.moe_decode import MAX_DECODE_TOKENS, triton_available
from freetoken.runtime.triton_support import next_pow2

SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus", "topk_softmax")  # the kernel's SCORING, by index
RENORM_EPS = 1e-20  # added to the chosen scores' sum (below any sum's rounding unless it is ~0)


@dataclass(frozen=True)
class RouterRule:
    """How a router turns a row of logits into k experts and their weights.

    scoring: each expert's score from its logit — softmax over the row, sigmoid, sqrt(softplus), or
    `topk_softmax` (gpt-oss: the raw logits choose, the chosen k are softmaxed). The choice is by score
    (+ the correction bias where `biased`), among the best `topk_group` of `n_group` equal groups (a group
    scored by its two best) where n_group > 1; the weights are the chosen scores, divided by their sum
    where `renormalize`, times `scaling`."""

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    biased: bool = False
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"router scoring {self.scoring!r}: one of {', '.join(SCORINGS)}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], not {self.topk_group}")

    def check(self, experts: int) -> None:
        """Refuses a rule that cannot choose k of `experts` (a ValueError naming the field)."""
        if experts % self.n_group:
            raise ValueError(f"n_group {self.n_group} does not divide the {experts} experts")
        kept = experts // self.n_group * self.topk_group
        if not 1 <= self.top_k <= kept:
            raise ValueError(f"top_k must be in [1, {kept}], not {self.top_k}")


@functools.cache
def _body() -> tuple[ModuleType, bool]:
    """(the kernel module, whether Triton's interpreter runs it)."""
    from triton.runtime.interpreter import InterpretedFunction

    from freetoken.runtime.moe.kernels import router_topk_triton as body

    return body, isinstance(body.router_topk_kernel, InterpretedFunction)


def choose_experts(
    logits: torch.Tensor, rule: RouterRule, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (fp32, bf16 or fp16; any row stride), bias [E] where rule.biased -> (ids [T, K]
    int64, weights [T, K] in `dtype`, the logits' by default), both contiguous, columns in descending
    choice value (see the module's note on ties)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], not {tuple(logits.shape)}")
    t, e = logits.shape
    rule.check(e)
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be fp32, bf16 or fp16, not {logits.dtype}")
    if rule.biased and (bias is None or bias.shape != (e,)):
        raise ValueError(
            f"a biased router needs a bias of [{e}], not {None if bias is None else tuple(bias.shape)}"
        )
    check_device(logits)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(t, rule.top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, rule.top_k, dtype=dtype or logits.dtype, device=logits.device)
    if t == 0:
        return ids, weights
    block = next_pow2(e)
    body, interpreted = _body()
    body.router_topk_kernel[(t,)](
        logits, bias.contiguous() if rule.biased else logits, ids, weights, logits.stride(0), rule.scaling,
        E=e, K=rule.top_k, BLOCK=block, K_BLOCK=next_pow2(rule.top_k), SCORING=SCORINGS.index(rule.scoring),
        BIASED=rule.biased, GROUPS=rule.n_group, G_BLOCK=next_pow2(rule.n_group), TOPK_GROUP=rule.topk_group,
        RENORM=rule.renormalize, COMPILED=not interpreted, num_warps=max(1, min(8, block // 512)),
    )  # fmt: skip
    return ids, weights


def router_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A softmax router's choice (Qwen3-MoE's): choose_experts with RouterRule(top_k, renormalize=...)."""
    return choose_experts(logits, RouterRule(top_k, renormalize=renormalize))


def expert_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Router logits [T, E] (fp32) -> scores [T, E] (topk_softmax: the logits themselves)."""
    if scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    return logits


def choose_experts_reference(
    logits: torch.Tensor, rule: RouterRule, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """choose_experts in plain torch, in fp32 from the logits on."""
    scores = expert_scores(logits.float(), rule.scoring)  # [T, E]
    choice = scores + bias.float() if rule.biased and bias is not None else scores
    if rule.n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, rule.n_group, e // rule.n_group)
        best = grouped.topk(2, dim=-1)[0].sum(dim=-1).topk(rule.topk_group, dim=-1)[1]  # [T, topk_group]
        keep = torch.zeros(t, rule.n_group, dtype=torch.bool, device=logits.device).scatter_(1, best, True)
        choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(t, e), float("-inf"))
    ids = choice.topk(rule.top_k, dim=-1)[1]
    if rule.scoring == "topk_softmax":  # in the logits' dtype, as gpt-oss's router computes it
        weights = F.softmax(logits.gather(1, ids), dim=-1, dtype=logits.dtype)
    else:
        weights = scores.gather(1, ids)
    if rule.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
    return ids, (weights * rule.scaling).to(dtype or logits.dtype)


def router_topk_reference(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_topk in plain torch."""
    return choose_experts_reference(logits, RouterRule(top_k, renormalize=renormalize))


def use_router_kernel(x: torch.Tensor) -> bool:
    """Whether the router of activations x [T, H] runs this kernel: a few rows on CUDA (the decode step),
    unless FREETOKEN_MOE_DECODE_KERNEL=torch turns the decode kernels off."""
    return x.is_cuda and x.shape[0] <= MAX_DECODE_TOKENS and _kernels_on()


@functools.cache
def _kernels_on() -> bool:
    return moe_decode_kernel_choice() != "torch" and triton_available()

"""Building blocks shared by architectures: norms, attention over the KV cache, the dense SwiGLU MLP."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from freetoken.runtime.models.kernels.cpu_linear import Linear

if TYPE_CHECKING:
    from freetoken.runtime.models.slot_decode import DecodeStep


class Embedding(nn.Embedding):
    """nn.Embedding without its random initial values: models are built on the meta device and filled from
    a checkpoint, and `normal_` on a meta tensor imports torch._dynamo (~1 s of every command's start)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    zero_centred = False  # the weight scales as it is (ZeroCenteredRMSNorm: by 1 + w)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, scale in the input dtype (the order the reference uses, which matters in bf16).
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def decode(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        return self(x)


def fuse_linear_rows(linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Store the weights (and biases) of `linears` (one input size) as row blocks of one matrix, so a decode
    step makes one GEMV of them; each keeps working on its view of it. -> (weight [ΣN, H], bias or None)."""
    with torch.no_grad():
        weight = torch.cat([p.weight for p in linears])  # [ΣN, H]
        bias = torch.cat([p.bias for p in linears]) if linears[0].bias is not None else None
        start = 0
        for p in linears:
            rows = p.weight.shape[0]
            p.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
            if bias is not None:
                p.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
            start += rows
    return weight, bias


def top_positions(index: torch.Tensor, k: int) -> torch.Tensor:
    """The k best positions of each row of index [N, S] fp32, ties going to the earlier position, so that
    scoring a row's S positions or a whole slot of them (the rest -inf) chooses alike -> [N, k] int64.

    Scores tie often (a key that no head's relu passes scores exactly 0), and a plain topk breaks ties by
    its algorithm, which differs with S. Each score becomes one int64 that orders as the float does, then
    by position: the float's bits made monotonic, shifted above S − position."""
    bits = (index + 0.0).contiguous().view(torch.int32).long()  # [N, S]; + 0.0 makes -0.0 a plain 0
    ordered = torch.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)  # monotonic in the float's value
    position = torch.arange(index.shape[-1], device=index.device)
    return ((ordered << 32) + (index.shape[-1] - position)).topk(k, dim=-1).indices


# cuDNN attention rebuilds its plan whenever the key length changes, which costs milliseconds of host
# time per decode step; the other SDPA kernels do not.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per head against the whole cache: q [NH, 1, D], k, v [KVH, S, D] -> [1, NH * D]."""
    nh, kvh, d = q.shape[0], k.shape[0], q.shape[-1]
    qg = q.reshape(kvh, nh // kvh, d)  # [KVH, G, D]: the query heads that share one KV head
    scores = torch.bmm(qg, k.transpose(1, 2)) * scale  # [KVH, G, S]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.bmm(probs, v).reshape(1, -1)  # [KVH, G, Dv] -> [1, NH * Dv]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [NH, T, D] for the last T positions of k, v [KVH, S, D] (S >= T) -> [T, NH * D].

    Query i sits at absolute position S - T + i and sees keys [0, S - T + i].
    """
    t, s = q.shape[1], k.shape[1]
    if t == 1:
        return decode_attention(q, k, v, scale)
    if s == t:
        with sdpa_kernel(_SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(
                q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=True
            )  # [1, NH, T, D]
        return out[0].transpose(0, 1).reshape(t, -1)
    # A chunk after cached keys: bottom-right causal alignment, which the flash and memory-efficient kernels
    # take natively (a dense boolean mask would fall back to the math kernel: [NH, T, S] scores in memory).
    # Their lower-right path wants as many key heads as query heads.
    from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: ~1 s at startup

    group = q.shape[0] // k.shape[0]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    with sdpa_kernel(_SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=causal_lower_right(t, s), scale=scale
        )
    return out[0].transpose(0, 1).reshape(t, -1)


# fp32 scores held at once by sink_window_attention (128 MiB): a long context takes fewer queries a chunk
SCORE_BUDGET = 1 << 25


def sink_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
    window: int | None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Attention with gpt-oss's two changes, for q [NH, T, D] at the last T positions of k, v [KVH, S, D]
    -> [T, NH * D]: each head's learned sink logit (sinks [NH]) joins every softmax's denominator, and with
    a `window` a query at position p sees keys (p − window, p] only.

    Plain math in chunks of queries ([KVH, G, chunk, keys] scores at a time, about SCORE_BUDGET of them
    unless `chunk` says); a window bounds the keys.
    """
    nh, t, d = q.shape
    kvh, s = k.shape[0], k.shape[1]
    g = nh // kvh
    keys = s if window is None else min(s, window + 256)
    chunk = chunk or max(1, min(256, SCORE_BUDGET // (nh * keys)))
    out = []
    for c0 in range(0, t, chunk):
        c = min(chunk, t - c0)
        first = s - t + c0  # absolute position of the chunk's first query
        lo = 0 if window is None else max(0, first - window + 1)
        hi = first + c
        keys = torch.arange(lo, hi, device=q.device)
        pos = torch.arange(first, hi, device=q.device)
        seen = keys[None, :] <= pos[:, None]  # [C, L]
        if window is not None:
            seen &= keys[None, :] > pos[:, None] - window
        qg = q[:, c0 : c0 + c].reshape(kvh, g * c, d)
        scores = torch.bmm(qg, k[:, lo:hi].transpose(1, 2)).float().view(kvh, g, c, -1) * scale
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(kvh, g, 1, 1).expand(kvh, g, c, 1)
            scores = torch.cat((scores, sink), dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., : hi - lo].to(v.dtype)  # [KVH, G, C, L]
        o = torch.bmm(probs.reshape(kvh, g * c, -1), v[:, lo:hi])  # [KVH, G * C, D]
        out.append(o.view(nh, c, d).transpose(0, 1).reshape(c, nh * d))
    return torch.cat(out)

"""Manifold-constrained hyper-connections (DeepSeek-V4): the residual is N parallel streams per token
([T, N, H]) instead of one.

Around each block (attention, MoE) one small projection of the RMS-normed, flattened streams gives three
mixes per token: `pre` [N] (sigmoid + ε) collapses the streams into the block's input Σ_n pre_n·s_n,
`post` [N] (2·sigmoid) spreads the block's output back over the streams, and `comb` [N, N] (a softmax
per row + ε, then Sinkhorn iterations towards a doubly stochastic matrix) mixes the old streams:

    s'_n = post_n · block(Σ_j pre_j s_j) + Σ_j comb[j, n] · s_j

Each mix is `sigmoid/softmax(scale_k · (W s̄)_k + base_k)` with s̄ the normed streams and one scale per
kind. After the last layer a head of the same form (pre only) collapses the streams for the final norm.
All mixes are computed in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.runtime.models.deepseek_v4_config import DeepseekV4ModelConfig
from freetoken.runtime.models.kernels.sinkhorn import sinkhorn


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim (an RMSNorm without weights), in x's dtype."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """transformers' names: fn [(2 + N)·N, N·H] (pre, post, comb rows), base [(2 + N)·N], scale [3]."""

    def __init__(self, cfg: DeepseekV4ModelConfig) -> None:
        super().__init__()
        n = self.streams = cfg.hc_mult
        self.iters, self.eps, self.norm_eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * cfg.hidden_size), requires_grad=False)
        self.base = nn.Parameter(torch.zeros((2 + n) * n), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, H] -> post [T, N], comb [T, N, N] (fp32), the block input [T, H]."""
        t, n = streams.shape[0], self.streams
        flat = unit_rms(streams.reshape(t, -1).float(), self.norm_eps)
        mixes = flat @ self.fn.float().T  # [T, (2 + N)·N]
        pre, post, comb = mixes.split((n, n, n * n), dim=-1)
        base_pre, base_post, base_comb = self.base.float().split((n, n, n * n))
        scale = self.scale.float()
        pre = torch.sigmoid(pre * scale[0] + base_pre) + self.eps
        post = 2 * torch.sigmoid(post * scale[1] + base_post)
        comb = torch.softmax(comb.view(t, n, n) * scale[2] + base_comb.view(n, n), dim=-1) + self.eps
        collapsed = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
        return post, sinkhorn(comb, self.iters, self.eps), collapsed


def spread(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block: post_n · out + Σ_j comb[j, n] · s_j -> [T, N, H]; out [T, H]."""
    dtype = streams.dtype
    return post.to(dtype)[..., None] * out[:, None, :] + comb.to(dtype).transpose(-1, -2) @ streams


class HyperHead(nn.Module):
    """transformers' names: hc_fn [N, N·H], hc_base [N], hc_scale [1]."""

    def __init__(self, cfg: DeepseekV4ModelConfig) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * cfg.hidden_size), requires_grad=False)
        self.hc_base = nn.Parameter(torch.zeros(n), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, N, H] -> [T, H]."""
        flat = unit_rms(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        pre = torch.sigmoid(flat @ self.hc_fn.float().T * self.hc_scale.float() + self.hc_base.float())
        return ((pre + self.eps)[..., None] * streams).sum(dim=1).to(streams.dtype)

"""DeepSeek-V4's compressed keys: every m positions of a layer pooled into one entry, and the cache row
that keeps what pooling needs.

A compressor projects each position x to raw keys c = W_kv x and gate logits z = W_z x (width S·d: S
series of d dims). Window w (positions [w·m, (w+1)·m)) gives entry w: per channel a softmax over its
slots of z + B (B [m, S·d]: a learned bias per slot), the slots' c weighted by it and summed, RMS-normed,
rope'd at position w·m. With one series (heavily compressed layers) the slots are the window's m
positions; with two (compressed-sparse layers, and their indexer) they are 2m: the first series of
window w − 1 then the second series of window w (window 0's first half is empty: weight 0).

Cache row of position p (one per layer, [1, S, width] in the engine's KV pool, no values):

    [ key (D) | compressor: c, z (S·d each), entry (d) | indexer: c, z (2·Di each), entry (Di) ]

Entry w lives in the row of its window's last position, (w + 1)·m − 1: every row depends only on the
positions up to its own, so any prefix of the cache is a valid cache of that prefix (truncation and the
prefix cache need nothing more). Rope pairs are adjacent dims (2j, 2j + 1), rotated in place, on the
trailing rope dims of a vector.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.runtime.config import RopeConfig
from freetoken.runtime.models.deepseek_v4_config import CSA, HCA, DeepseekV4ModelConfig
from freetoken.runtime.models.kernels.cpu_linear import Linear
from freetoken.runtime.models.layers import RMSNorm, top_positions
from freetoken.runtime.models.rope import RotaryEmbedding


def pair_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] with its last 2P dims rotated as P adjacent pairs by cos, sin [T, P]; the leading
    D − 2P dims pass through."""
    rope_dims = 2 * cos.shape[-1]
    rest, rope = x[..., :-rope_dims], x[..., -rope_dims:]
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((rest, rotated.to(x.dtype)), dim=-1)


class PairRope:
    """cos, sin [T, P] of each rope pair's angle at positions [T] (P = rope dims / 2)."""

    def __init__(self, rope: RopeConfig, rope_dims: int) -> None:
        self.table = RotaryEmbedding(rope, rope_dims)
        self.pairs = rope_dims // 2

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.table(positions, dtype)  # [T, 2P]: each angle twice (halves)
        return cos[..., : self.pairs], sin[..., : self.pairs]


@dataclass(frozen=True)
class CompressorColumns:
    """Where one compressor's raw keys, gate logits and entries sit in a cache row."""

    start: int
    dim: int  # d: an entry's width
    series: int  # S: 1 (a window per entry) or 2 (overlapping windows)

    @property
    def raw_width(self) -> int:
        return self.series * self.dim

    @property
    def keys(self) -> slice:
        return slice(self.start, self.start + self.raw_width)

    @property
    def gates(self) -> slice:
        return slice(self.start + self.raw_width, self.start + 2 * self.raw_width)

    @property
    def entry(self) -> slice:
        return slice(self.start + 2 * self.raw_width, self.end)

    @property
    def end(self) -> int:
        return self.start + 2 * self.raw_width + self.dim


@dataclass(frozen=True)
class RowLayout:
    """One layer kind's cache row: its key, then its compressor's and indexer's columns (if any)."""

    head_dim: int
    compressor: CompressorColumns | None = None
    indexer: CompressorColumns | None = None

    @staticmethod
    def of(cfg: DeepseekV4ModelConfig, kind: str) -> RowLayout:
        d = cfg.head_dim
        if kind == HCA:
            return RowLayout(d, CompressorColumns(d, d, 1))
        if kind == CSA:
            compressor = CompressorColumns(d, d, 2)
            return RowLayout(d, compressor, CompressorColumns(compressor.end, cfg.index_head_dim, 2))
        return RowLayout(d)

    @property
    def key(self) -> slice:
        return slice(0, self.head_dim)

    @property
    def width(self) -> int:
        last = self.indexer or self.compressor
        return self.head_dim if last is None else last.end


class Compressor(nn.Module):
    """transformers' names: kv_proj, gate_proj, position_bias [m, S·d], kv_norm."""

    def __init__(self, hidden: int, dim: int, rate: int, series: int, eps: float) -> None:
        super().__init__()
        self.dim, self.rate, self.series = dim, rate, series
        self.kv_proj = Linear(hidden, series * dim, bias=False)
        self.gate_proj = Linear(hidden, series * dim, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, series * dim), requires_grad=False)
        self.kv_norm = RMSNorm(dim, eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> raw keys, gate logits [T, S·d] (what the cache row keeps)."""
        return self.kv_proj(x), self.gate_proj(x)

    def pool(self, keys: torch.Tensor, gates: torch.Tensor, first_is_zero: bool) -> torch.Tensor:
        """Raw keys, gate logits [n·m, S·d] of whole windows -> their entries [n', d] before rope.

        One series: n' = n, a window each. Two: entries of windows 1..n−1 of what is given (each with
        its predecessor's first series), plus window 0 when `first_is_zero` (the sequence's first
        window, whose predecessor is empty)."""
        m, d = self.rate, self.dim
        keys = keys.view(-1, m, self.series * d)
        gates = gates.view(-1, m, self.series * d).float() + self.position_bias.float()  # [n, m, S·d]
        if self.series == 2:
            prev_keys, prev_gates = keys[:-1, :, :d], gates[:-1, :, :d]  # first series: windows 0..n−2
            cur_keys, cur_gates = keys[1:, :, d:], gates[1:, :, d:]  # second series: windows 1..n−1
            if first_is_zero:
                prev_keys = torch.cat((keys.new_zeros(1, m, d), prev_keys))
                prev_gates = torch.cat((gates.new_full((1, m, d), float("-inf")), prev_gates))
                cur_keys, cur_gates = keys[:, :, d:], gates[:, :, d:]
            keys, gates = torch.cat((prev_keys, cur_keys), dim=1), torch.cat((prev_gates, cur_gates), dim=1)
        weights = torch.softmax(gates, dim=1).to(keys.dtype)  # [n', slots, d]: per channel over the slots
        return self.kv_norm((keys * weights).sum(dim=1))

    def pool_closing(self, keys: torch.Tensor, gates: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`pool` of one closing window per row: keys, gate logits [B, S·m, S·d] of its S·m rows (two
        series: the window before, then it), valid [B, S·m] (rows before position 0 weigh nothing, as
        the first window's empty predecessor) -> entries [B, d] before rope."""
        m, d = self.rate, self.dim
        gates = gates.float()
        bias = self.position_bias.float()  # [m, S·d]
        if self.series == 2:
            keys = torch.cat((keys[:, :m, :d], keys[:, m:, d:]), dim=1)  # [B, 2m, d]
            gates = torch.cat((gates[:, :m, :d] + bias[:, :d], gates[:, m:, d:] + bias[:, d:]), dim=1)
        else:
            gates = gates + bias
        keys = keys.masked_fill(~valid[..., None], 0.0)
        weights = torch.softmax(gates.masked_fill(~valid[..., None], float("-inf")), dim=1).to(keys.dtype)
        return self.kv_norm((keys * weights).sum(dim=1))

    def emit(self, rows: torch.Tensor, cols: CompressorColumns, start: int, end: int, rope: PairRope) -> None:
        """Write the entries of the windows that close among positions [start, end) into `rows` [end, W]
        (the cache's rows, raw columns already written), each in its window's last row."""
        m = self.rate
        w0, w1 = start // m, end // m  # windows w0..w1−1 close here
        if w1 <= w0:
            return
        first = w0 - 1 if self.series == 2 and w0 > 0 else w0  # two series read the window before too
        span = slice(first * m, w1 * m)
        entries = self.pool(rows[span, cols.keys], rows[span, cols.gates], self.series == 2 and w0 == 0)
        positions = torch.arange(w0, w1, device=rows.device) * m  # an entry sits at its window's start
        cos, sin = rope(positions, entries.dtype)
        rows[w0 * m + m - 1 : w1 * m : m, cols.entry] = pair_rotary(entries, cos, sin).to(rows.dtype)

    def entries(self, rows: torch.Tensor, cols: CompressorColumns) -> torch.Tensor:
        """The entries of every closed window among `rows` [S, W] -> [S // m, d]."""
        return rows[self.rate - 1 :: self.rate, cols.entry]


def visible_entries(positions: torch.Tensor, entries: int, rate: int) -> torch.Tensor:
    """[T, n] bool: entry w is visible from position p once its window closed, (w + 1)·m <= p + 1."""
    return torch.arange(entries, device=positions.device)[None, :] < ((positions + 1) // rate)[:, None]


class IndexScorer(nn.Module):
    """transformers' name: weights_proj (each index head's weight per position)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.weights_proj = Linear(hidden, heads, bias=False)


class Indexer(Compressor):
    """The compressed-sparse layers' indexer: its own two-series compressor at Di dims (the index keys),
    and per query heads q_h = W_q q_res (q_res: the attention's normed low-rank query), rope'd at the
    query's position. Entry w scores Σ_h w_h · relu(q_h · k_w) / √Di with w_h = W_w x / √H_i; the best
    `index_topk` visible entries are kept."""

    def __init__(self, cfg: DeepseekV4ModelConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, cfg.csa_rate, 2, cfg.rms_norm_eps)
        assert cfg.q_lora_rank
        self.heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = Linear(cfg.q_lora_rank, self.heads * self.dim, bias=False)
        self.scorer = IndexScorer(cfg.hidden_size, self.heads)

    def select(
        self,
        x: torch.Tensor,
        q_res: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        rope: PairRope,
    ) -> torch.Tensor:
        """Queries x [T, H] (q_res [T, R]) at `positions` [T] against index keys [n, Di] -> kept [T, n]."""
        t, n = x.shape[0], keys.shape[0]
        visible = visible_entries(positions, n, self.rate)
        if n == 0:
            return visible
        top = self.top(x, q_res, positions, keys[None].expand(t, n, -1), visible, rope)  # [T, k]
        kept = torch.zeros(t, n, dtype=torch.bool, device=x.device).scatter_(1, top, True)
        return kept & visible

    def top(
        self,
        x: torch.Tensor,
        q_res: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        visible: torch.Tensor,
        rope: PairRope,
    ) -> torch.Tensor:
        """Each query's index keys keys [T, n, Di] (visible [T, n]) -> the best min(index_topk, n) entries
        [T, k], ties to the earlier entry (layers.top_positions)."""
        t, n = keys.shape[:2]
        q = self.q_b_proj(q_res).view(t, self.heads, self.dim)  # [T, H_i, Di]
        q = pair_rotary(q.transpose(0, 1), *rope(positions, q.dtype)).transpose(0, 1)
        scores = F.relu(torch.einsum("thd,tnd->htn", q.float(), keys.float())) * self.dim**-0.5  # [H_i, T, n]
        weights = self.scorer.weights_proj(x).float() * self.heads**-0.5  # [T, H_i]
        index = torch.einsum("th,htn->tn", weights, scores).masked_fill(~visible, float("-inf"))
        return top_positions(index, min(self.topk, n))


class SparseCompressor(Compressor):
    """The compressed-sparse layers' compressor (two series at D dims) with its indexer."""

    def __init__(self, cfg: DeepseekV4ModelConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.head_dim, cfg.csa_rate, 2, cfg.rms_norm_eps)
        self.indexer = Indexer(cfg)


def compressor_of(cfg: DeepseekV4ModelConfig, kind: str) -> Compressor | None:
    if kind == CSA:
        return SparseCompressor(cfg)
    if kind == HCA:
        return Compressor(cfg.hidden_size, cfg.head_dim, cfg.hca_rate, 1, cfg.rms_norm_eps)
    return None

"""DeepSeek-V4's attention: one shared key (= value) head over a sliding window, plus compressed entries
of the whole past (compressed_kv.py), a learned sink logit per head, and a grouped low-rank output.

Per position: q_res = RMSNorm(W_qa x); heads q_h = unit_rms(W_qb q_res)_h; the key k = RMSNorm(W_kv x),
both rope'd (adjacent pairs, trailing rope dims). A query at p sees the keys of (p − window, p], and:
on heavily-compressed layers every entry whose window closed by p, on compressed-sparse layers those
of them its indexer keeps. One softmax over both (with the head's sink) at scale 1/√D; the values are
the keys. The output's rope dims are rotated back by −p (values carried their key's rotation), then
heads are grouped: G groups of NH/G heads, each projected to R dims (o_a_proj, block-diagonal), and the
G·R dims to the hidden size (o_b_proj).
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.runtime.kv.cache import KVCache
from freetoken.runtime.models.compressed_decode import attend_slots, entry_rows, write_closing_entries
from freetoken.runtime.models.compressed_kv import (
    Compressor,
    CompressorColumns,
    Indexer,
    PairRope,
    RowLayout,
    SparseCompressor,
    compressor_of,
    pair_rotary,
    visible_entries,
)
from freetoken.runtime.models.deepseek_v4_config import DeepseekV4ModelConfig
from freetoken.runtime.models.hyper_connections import unit_rms
from freetoken.runtime.models.kernels.cpu_linear import Linear
from freetoken.runtime.models.layers import SCORE_BUDGET, RMSNorm
from freetoken.runtime.models.slot_decode import DecodeStep, slot_rows


class CompressedAttention(nn.Module):
    """transformers' names: q_a_proj, q_a_norm, q_b_proj, kv_proj, kv_norm, o_a_proj, o_b_proj, sinks,
    and `compressor` (with its `indexer` on compressed-sparse layers)."""

    def __init__(self, cfg: DeepseekV4ModelConfig, layer: int) -> None:
        super().__init__()
        assert cfg.q_lora_rank
        self.layer, self.kind = layer, cfg.layer_kinds[layer]
        self.heads, self.dim, self.window = cfg.num_heads, cfg.head_dim, cfg.sliding_window
        self.groups, self.eps = cfg.o_groups, cfg.rms_norm_eps
        self.layout = RowLayout.of(cfg, self.kind)
        self.row_width = cfg.kv_dims[1]
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = Linear(cfg.q_lora_rank, self.heads * d, bias=False)
        self.kv_proj = Linear(h, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.o_a_proj = Linear(self.heads * d // self.groups, self.groups * cfg.o_lora_rank, bias=False)
        self.o_b_proj = Linear(self.groups * cfg.o_lora_rank, h, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.heads), requires_grad=False)
        self.compressor: Compressor | None = compressor_of(cfg, self.kind)

    def _project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> queries [NH, T, D] (rope'd), cache rows [T, W] (entries still zero), q_res [T, R]."""
        t = x.shape[0]
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = unit_rms(self.q_b_proj(q_res).view(t, self.heads, self.dim), self.eps).transpose(0, 1)
        rows = x.new_zeros(t, self.row_width)
        rows[:, self.layout.key] = pair_rotary(self.kv_norm(self.kv_proj(x)), cos, sin)
        for module, cols in self._compressors():
            rows[:, cols.keys], rows[:, cols.gates] = module.project(x)
        return pair_rotary(q, cos, sin), rows, q_res

    def _compressors(self) -> list[tuple[Compressor, CompressorColumns]]:
        """(compressor, its columns) of this layer: none, the compressor, or it and its indexer."""
        layout, found = self.layout, []
        if self.compressor is not None and layout.compressor is not None:
            found.append((self.compressor, layout.compressor))
            if isinstance(self.compressor, SparseCompressor) and layout.indexer is not None:
                found.append((self.compressor.indexer, layout.indexer))
        return found

    def _attend_sequence(
        self,
        q: torch.Tensor,
        rows: torch.Tensor,
        x: torch.Tensor,
        q_res: torch.Tensor,
        rope: PairRope,
        kv: KVCache,
        start: int,
    ) -> torch.Tensor:
        """One sequence's T new positions (from `start`): write their rows, close their windows, attend
        -> [T, NH, D] (before the output rotation)."""
        t = x.shape[0]
        end = start + t
        cache, _ = kv.write(self.layer, start, rows[None], rows[None, :, :0])
        cached = cache[0]  # [end, W], a view of the pool: entries are written into it in place
        compressors = self._compressors()
        for module, cols in compressors:
            module.emit(cached, cols, start, end, rope)
        positions = torch.arange(start, end, device=x.device)
        entries, kept = None, None
        if compressors:
            compressor, cols = compressors[0]
            entries = compressor.entries(cached, cols)  # [n, D]
            kept = visible_entries(positions, entries.shape[0], compressor.rate)
            if len(compressors) == 2:  # the indexer keeps some of the visible ones
                indexer, index_cols = compressors[1]
                assert isinstance(indexer, Indexer)
                kept = indexer.select(x, q_res, positions, indexer.entries(cached, index_cols), rope)
        return self._attend(q, cached[:, self.layout.key], entries, kept, start)

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        entries: torch.Tensor | None,
        kept: torch.Tensor | None,
        start: int,
    ) -> torch.Tensor:
        """q [NH, T, D] at positions start.., keys [S, D] (S = start + T), entries [n, D] with kept [T, n]
        -> [T, NH, D]. Chunks of queries bound the scores held at once (about SCORE_BUDGET)."""
        nh, t, _ = q.shape
        n = 0 if entries is None else entries.shape[0]
        chunk = max(1, min(256, SCORE_BUDGET // (nh * (self.window + 256 + n))))
        scale = self.dim**-0.5
        out = []
        for c0 in range(0, t, chunk):
            c = min(chunk, t - c0)
            first = start + c0  # the chunk's first query position
            lo = max(0, first - self.window + 1)
            key_pos = torch.arange(lo, first + c, device=q.device)
            query_pos = torch.arange(first, first + c, device=q.device)
            seen = (key_pos[None, :] <= query_pos[:, None]) & (
                key_pos[None, :] > query_pos[:, None] - self.window
            )
            qc, window_keys = q[:, c0 : c0 + c], keys[lo : first + c]
            parts = [(qc @ window_keys.T).float().masked_fill(~seen, float("-inf")) * scale]  # [NH, C, L]
            if n:
                assert entries is not None and kept is not None
                parts.append((qc @ entries.T).float().masked_fill(~kept[c0 : c0 + c], float("-inf")) * scale)
            parts.append(self.sinks.float().view(nh, 1, 1).expand(nh, c, 1))
            probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1).to(q.dtype)
            length = window_keys.shape[0]
            o = probs[..., :length] @ window_keys  # [NH, C, D]
            if n:
                o = o + probs[..., length : length + n] @ entries
            out.append(o.transpose(0, 1))
        return torch.cat(out)

    def _output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """o [T, NH, D] -> [T, H]: rope dims rotated back, then the grouped output projection."""
        t = o.shape[0]
        o = pair_rotary(o.transpose(0, 1), cos, -sin).transpose(0, 1)
        grouped = o.reshape(t, self.groups, -1)  # [T, G, NH·D/G]: consecutive heads per group
        weight = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1])  # [G, R, NH·D/G]
        return self.o_b_proj(torch.einsum("tgi,gri->tgr", grouped, weight).reshape(t, -1))

    def forward(self, x: torch.Tensor, rope: PairRope, kv: KVCache, start: int) -> torch.Tensor:
        """x [T, H] continuing kv at `start` -> [T, H]."""
        positions = torch.arange(start, start + x.shape[0], device=x.device)
        cos, sin = rope(positions, x.dtype)
        q, rows, q_res = self._project(x, cos, sin)
        return self._output(self._attend_sequence(q, rows, x, q_res, rope, kv, start), cos, sin)

    def decode(self, x: torch.Tensor, step: DecodeStep, rope: PairRope) -> torch.Tensor:
        """x [B, H] normed, one new position per row -> [B, H] (compressed_decode.py)."""
        rows, ops = step.rows, step.ops
        cos, sin = rope(rows.positions, x.dtype)
        q, new_rows, q_res = self._project(x, cos, sin)  # [NH, B, D], [B, W], [B, R]
        cache, _ = step.kv(self.layer)  # [S, 1, CAP, W]
        ops.slot_write(new_rows, cache, rows.slots, rows.positions)
        compressors = self._compressors()
        for module, cols in compressors:
            write_closing_entries(module, cols, cache, rows.slots, rows.positions, rope, ops.slot_write)
        p = rows.positions.long()
        at = p[:, None] - self.window + 1 + torch.arange(self.window, device=x.device)  # [B, window]
        keys = slot_rows(cache, rows.slots, at, self.layout.key)
        entries, kept = None, None
        if compressors:
            compressor, cols = compressors[0]
            at_entries = entry_rows(cache, compressor.rate)[None].expand(x.shape[0], -1)  # [B, n]
            kept = at_entries < p[:, None] + 1  # visible: the window closed by p
            if len(compressors) == 2:  # the indexer keeps some of the visible ones
                indexer, index_cols = compressors[1]
                assert isinstance(indexer, Indexer)
                index_keys = slot_rows(cache, rows.slots, at_entries, index_cols.entry)
                top = indexer.top(x, q_res, rows.positions, index_keys, kept, rope)  # [B, k]
                at_entries, kept = at_entries.gather(1, top), kept.gather(1, top)
            entries = slot_rows(cache, rows.slots, at_entries, cols.entry)
        o = attend_slots(q.transpose(0, 1), keys, at >= 0, entries, kept, self.sinks, self.dim**-0.5)
        return self._output(o, cos, sin)

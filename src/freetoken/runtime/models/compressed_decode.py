"""DeepSeek-V4's compressed attention in the decode step over the static KV pool: one new position per row,
every input a device tensor, nothing read back (graph-capturable). The math is CompressedAttention's
(compressed_attention.py) and the compressors' (compressed_kv.py), for each row over its own slot:

- the row's cache row (its key, the compressors' raw keys and gate logits) goes to (slot, position);
- where the position closes a window ((p + 1) % m == 0), the compressor pools the window's rows (with the
  window before it for two series; rows before position 0 weigh nothing) into the entry written in the
  row's entry columns; rows whose window stays open write nothing there;
- the query attends to the last `window` keys of its slot and to the visible entries — every one on a
  heavily-compressed layer, those its indexer keeps on a compressed-sparse one (scored over every entry
  row of the slot, the not-yet-visible masked) — with its head's sink in the softmax.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from freetoken.runtime.models.compressed_kv import Compressor, CompressorColumns, PairRope, pair_rotary
from freetoken.runtime.models.slot_decode import slot_rows


def write_closing_entries(
    compressor: Compressor,
    cols: CompressorColumns,
    cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    rope: PairRope,
    write: Callable[..., None],
) -> None:
    """Each row whose position closes a window writes the window's entry (pooled, normed, rope'd at the
    window's start) into its cache row's entry columns; `write` is the step's slot_write."""
    m, span = compressor.rate, compressor.series * compressor.rate
    p = positions.long()
    at = p[:, None] + 1 - span + torch.arange(span, device=p.device)  # [B, S·m]: the rows pooled
    entry = compressor.pool_closing(
        slot_rows(cache, slots, at, cols.keys), slot_rows(cache, slots, at, cols.gates), at >= 0
    )  # [B, d]
    start = ((p + 1) // m - 1).clamp(min=0) * m  # the closing window's first position
    entry = pair_rotary(entry, *rope(start, entry.dtype))
    closes = (p + 1) % m == 0
    write(
        entry.to(cache.dtype).contiguous(), cache[..., cols.entry], slots, torch.where(closes, positions, -1)
    )


def entry_rows(cache: torch.Tensor, rate: int) -> torch.Tensor:
    """The positions of a slot's entry rows (each window's last) [CAP // m]."""
    return torch.arange(rate - 1, cache.shape[2], rate, device=cache.device)


def attend_slots(
    q: torch.Tensor,
    keys: torch.Tensor,
    key_valid: torch.Tensor,
    entries: torch.Tensor | None,
    entry_valid: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, NH, D] against each row's keys [B, L, D] (key_valid [B, L]) and entries [B, n, D] (entry_valid
    [B, n]), one softmax with each head's sink -> [B, NH, D] (values are the keys)."""
    b, nh, _ = q.shape
    parts = [
        torch.einsum("bhd,bld->bhl", q, keys).float().masked_fill(~key_valid[:, None], float("-inf")) * scale
    ]
    if entries is not None:
        assert entry_valid is not None
        scores = torch.einsum("bhd,bnd->bhn", q, entries).float()
        parts.append(scores.masked_fill(~entry_valid[:, None], float("-inf")) * scale)
    parts.append(sinks.float().view(1, nh, 1).expand(b, nh, 1))
    probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1).to(q.dtype)
    length = keys.shape[1]
    o = torch.einsum("bhl,bld->bhd", probs[..., :length], keys)
    if entries is not None:
        o = o + torch.einsum("bhn,bnd->bhd", probs[..., length : length + entries.shape[1]], entries)
    return o
